"""The `kt-sglang` command and the machine facts it reports (hwloc topology, CPU paths)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from kt_sglang.engine.native import _native
from kt_sglang.engine.pools import plan_pools


def kt_sglang(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    exe = shutil.which("kt-sglang", path=os.path.dirname(sys.executable))
    assert exe, "the kt-sglang console script is not installed next to this Python"
    return subprocess.run(
        [exe, *args], capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})}
    )


def test_version():
    r = kt_sglang("version")
    assert r.returncode == 0
    assert r.stdout.startswith("kt-sglang 0.1.0")
    assert "kernel paths: scalar" in r.stdout


def test_doctor_reports_machine():
    r = kt_sglang("doctor")
    assert r.returncode == 0, r.stdout + r.stderr
    topo = _native.topology()
    assert f"{len(topo['nodes'])} node(s)" in r.stdout
    assert f"chosen path: {_native.best_isa()}" in r.stdout
    for isa in _native.supported_isas():
        assert isa in r.stdout
    assert "torch" in r.stdout and "sglang" in r.stdout and "GPU:" in r.stdout
    driver = "CUDA driver: found" if _native.cuda_host_launch_available() else "CUDA driver: no CUDA driver"
    assert driver in r.stdout and "llmcompressor" in r.stdout
    assert f"stream signal: {_native.stream_signal()}" in r.stdout
    if not torch.cuda.is_available():
        assert "GPU prefill: no GPU" in r.stdout
    else:
        assert "GPU prefill: pinned host-to-device" in r.stdout and "auto would stream chunks of" in r.stdout
    ahead = _native.weight_prefetch_bytes()
    assert "decode weight prefetch: " + (f"{ahead} bytes ahead" if ahead else "off") in r.stdout


def test_doctor_checks_a_model_and_the_plugin_list(tmp_path):
    """RAM and disk a model needs per method (computed here from its shapes), and SGLANG_PLUGINS."""
    from kt_sglang.tiny_model import TinyMoESpec, write_tiny_moe

    spec = TinyMoESpec()
    model = write_tiny_moe(tmp_path / "m", spec)
    r = kt_sglang("doctor", "--model", str(model), "--method", "AMXINT8", env={"SGLANG_PLUGINS": "other"})
    assert r.returncode == 1
    assert re.search(r"RAM: [\d.]+ GiB, [\d.]+ GiB available", r.stdout)
    H, I, group = spec.hidden_size, spec.moe_intermediate_size, 64
    per_expert = 3 * H * I + 2 * (2 * I * (H // group) + H * (I // group))  # int8 weights, fp16 scales
    mib = spec.num_layers * spec.num_experts * per_expert / 2**20
    assert f"as AMXINT8 the CPU experts take {mib:.1f} MiB of RAM" in r.stdout
    assert "problem: SGLANG_PLUGINS='other' leaves kt_sglang out" in r.stdout
    assert "--kt-cpuinfer" in r.stdout and "left to SGLang's scheduler" in r.stdout


def test_doctor_reports_bad_isa_variable():
    r = kt_sglang("doctor", env={"KT_SGLANG_ISA": "avx9000"})
    assert r.returncode == 1
    assert "problem: KT_SGLANG_ISA='avx9000' is not an ISA path" in r.stdout


def test_topology_matches_the_os():
    topo = _native.topology()
    cores = [c for n in topo["nodes"] for c in n["cores"]]
    assert len(cores) == len(set(cores)) >= 1
    assert set(cores) <= set(range(os.cpu_count()))
    sysfs = "/sys/devices/system/node"
    if os.path.isdir(sysfs):
        nodes = [d for d in os.listdir(sysfs) if d.startswith("node") and d[4:].isdigit()]
        assert len(topo["nodes"]) == max(1, len(nodes))


def test_pool_plan_places_distinct_cores():
    node = _native.topology()["nodes"][0]
    if len(node["cores"]) < 2:
        pytest.skip("needs a NUMA node with 2 cores")
    layout = plan_pools(2, 2, [node["os_index"]] * 2)
    assert layout.pools == 2
    assert sorted(c for pool in layout.cpus for c in pool) == sorted(node["cores"][:2])


def test_best_isa_follows_cpuid():
    f = _native.cpu_features()
    supported = _native.supported_isas()
    assert supported[0] == "scalar"
    assert ("amx" in supported) == (
        f["amx_int8"] and f["amx_bf16"] and f["amx_permitted"] and f["avx512_vnni"]
    )
    assert ("avx2" in supported) == (f["avx2"] and f["fma"] and f["os_avx"])


@pytest.mark.slow
def test_check_engine_runs_within_bounds():
    r = kt_sglang("check-engine")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all methods within their error bounds" in r.stdout


@pytest.mark.slow
def test_demo_continues_a_line_with_cpu_experts(tmp_path):
    r = kt_sglang("demo", "--workdir", str(tmp_path), "--max-tokens", "8")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "continuation:\nROMEO:" in r.stdout and "8 tokens in" in r.stdout
    cpu, gpu = (int(x) for x in re.search(r"(\d+) on the CPU engine, (\d+) on the GPU", r.stdout).groups())
    assert cpu > 0 and gpu > 0
    assert not (tmp_path / "server.log").read_text().count("Traceback")


def test_bench_quick_writes_json(tmp_path):
    import json

    out = tmp_path / "bench.json"
    r = kt_sglang("bench", "--quick", "--methods", "AMXINT4", "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(out.read_text())
    row = [r for r in data["rows"] if r["method"] == "AMXINT4"][0]
    assert row["rel_error"] < 0.16
    assert all(p["ms"] > 0 for p in row["decode"].values())


def test_bench_runs_kt_kernel_side_by_side(tmp_path):
    """`--kt-kernel-python` runs kt-kernel 0.7.2's layer in its own process, interleaved with ours."""
    import json

    python = os.environ.get("KT_SGLANG_KT_KERNEL_PYTHON")
    if not python:
        pytest.fail(
            "needs KT_SGLANG_KT_KERNEL_PYTHON, a Python that imports kt-kernel 0.7.2: .ci/run sets it"
        )
    if not _native.cpu_features()["avx512bw"]:
        pytest.skip("kt-kernel's AMXINT8 needs a CPU with AVX-512 (this one has none)")
    out = tmp_path / "bench.json"
    r = kt_sglang(
        "bench",
        "--quick",
        "--methods",
        "AMXINT8",
        "--no-baseline",
        "--kt-kernel-python",
        python,
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(out.read_text())
    assert data["machine"]["kt_kernel"]["kt_kernel"] == "0.7.2"
    (row,) = data["rows"]
    points = list(row["decode"].values()) + list(row["prefill"].values())
    assert len(points) == 3 and row["kt_kernel_copies"] >= 1
    for p in points:
        assert p["kt_kernel_ms"] > 0
        assert p["vs_kt_kernel"] == pytest.approx(p["kt_kernel_ms"] / p["ms"])
    assert "x kt-kernel" in r.stdout


def test_bench_says_when_kt_kernel_cannot_run():
    r = kt_sglang("bench", "--quick", "--methods", "AMXINT8", "--kt-kernel-python", sys.executable)
    assert r.returncode == 1
    assert (
        f"kt-kernel worker, version: RuntimeError: kt-kernel is not installed for {sys.executable}"
        in r.stderr
    )
    r = kt_sglang("bench", "--quick", "--kt-kernel-python", "/nonexistent/python")
    assert r.returncode == 1 and "--kt-kernel-python /nonexistent/python: cannot start it" in r.stderr


def test_serve_dry_run_takes_the_model_either_way(tmp_path):
    """`kt-sglang serve X` and `serve --model-path X` build the same command; a converted
    --kt-weight-path brings its own method (no --kt-method is added)."""
    from kt_sglang.tiny_model import write_tiny_moe
    from kt_sglang.weights.convert_cpu import main as convert_cpu

    model = write_tiny_moe(tmp_path / "m")
    positional = kt_sglang("serve", str(model), "--dry-run", "--port", "1234")
    flag = kt_sglang("serve", "--model-path", str(model), "--dry-run", "--port", "1234")
    assert positional.returncode == 0 and flag.returncode == 0, positional.stderr + flag.stderr
    assert positional.stdout == flag.stdout
    command = positional.stdout.strip()
    assert "-m sglang.launch_server --model-path" in command and "--kt-method AMXINT4" in command
    assert command.endswith("--port 1234")
    out = tmp_path / "int8"
    assert convert_cpu(["--input-path", str(model), "--output", str(out), "--quant-method", "INT8"]) == 0
    converted = kt_sglang("serve", str(model), "--dry-run", "--kt-weight-path", str(out))
    assert converted.returncode == 0 and "--kt-method" not in converted.stdout, converted.stdout
    both = kt_sglang("serve", str(model), "--model-path", str(tmp_path), "--dry-run")
    assert both.returncode == 2 and "two models given" in both.stderr


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and int(pid) != os.getpid():
            found.append(f"{pid}: {cmdline[:200]}")
    return found


@pytest.mark.slow
@pytest.mark.parametrize(
    "marker, sig",
    [
        ("==> converting", signal.SIGINT),
        ("==> serving:", signal.SIGINT),  # while SGLang starts (in a session of its own)
        ("==> serving:", signal.SIGTERM),
        ("==> server ready", signal.SIGINT),
    ],
)
def test_demo_interrupted_leaves_no_process(tmp_path, marker, sig):
    exe = shutil.which("kt-sglang", path=os.path.dirname(sys.executable))
    proc = subprocess.Popen(
        [exe, "demo", "--workdir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        # A test run started in the background (nohup, `&` in a script) hands SIGINT down ignored,
        # and Python then installs no KeyboardInterrupt handler: give the demo the default, as a
        # terminal would.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(marker):
            break
    assert seen and seen[-1].startswith(marker), "".join(seen)[-3000:]
    if marker == "==> serving:":
        time.sleep(3)  # SGLang's processes exist by now
    proc.send_signal(sig)
    rest = proc.stdout.read()
    assert proc.wait(timeout=120) in (130, 128 + sig), "".join(seen)[-2000:] + rest[-2000:]
    assert "Traceback" not in rest, rest[-3000:]
    deadline = time.monotonic() + 30
    while (left := _processes_mentioning(str(tmp_path))) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, left
