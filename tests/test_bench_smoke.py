"""The CPU-reproducible benchmarks of the GPU path run end to end on the CPU (their figures live in
docs/, not in tests): the model-shaped decode step and the streaming prefill on the CPU device, and the
thread-contention model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def run_bench(script: str, tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "result.json"
    r = subprocess.run(
        [sys.executable, str(BENCH / script), *args, "--out", str(out)],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_prefill_benchmark_on_the_cpu_device(tmp_path):
    """The streaming prefill against the engine (torch twins on the CPU device): every chunk and
    method reported, the copies counted (three layers: nothing stays staged between passes)."""
    r = run_bench(
        "bench_prefill.py", tmp_path, "--device", "cpu", "--model", "tiny", "--chunks", "16", "64",
        "--methods", "AMXINT4", "BF16", "--repeats", "1",
    )  # fmt: skip
    assert r["device"] == "cpu" and r["layers"] == 3 and r["pinned_h2d_gbps"] is None
    assert [m["method"] for m in r["methods"]] == ["AMXINT4", "BF16"]
    for m in r["methods"]:
        assert m["layer_bytes"] > 0 and [row["chunk"] for row in m["rows"]] == [16, 64]
        for row in m["rows"]:
            assert row["cpu_tokens_per_s"] > 0 and row["stream_tokens_per_s"] > 0
            assert row["copy_ms"] > 0 and row["compute_ms"] > 0 and row["stream_ms"] > 0


@pytest.mark.slow
def test_decode_step_benchmark_on_the_cpu_device(tmp_path):
    r = run_bench(
        "bench_decode_step.py", tmp_path, "--device", "cpu", "--model", "tiny", "--layers", "2",
        "--batches", "1", "4", "--context", "64", "--repeats", "2",
    )  # fmt: skip
    assert r["device"] == "cpu" and not r["cuda_graph"] and r["engine_threads"] >= 1
    points = {(row["batch"], row["hot_fraction"], row["deferral"]) for row in r["rows"]}
    # the tiny model routes 4 experts a token: at most 3 deferred
    assert points == {(b, h, d) for b in (1, 4) for h in (0.0, 0.1, 0.25) for d in (0, 1, 2)}
    assert all(row["step_ms"] > 0 and row["tokens_per_s"] > 0 for row in r["rows"])
    assert all(p["gpu_ms"] > 0 and p["cpu_ms"] > 0 for p in r["parts"]) and len(r["parts"]) == 6
    assert set(r["deferral_pays_up_to"]) == {"0.0", "0.1", "0.25"}
    assert all(b in (0, 1, 4) for b in r["deferral_pays_up_to"].values())


@pytest.mark.slow
def test_decode_step_benchmark_compares_placements_on_a_drifting_trace(tmp_path):
    r = run_bench(
        "bench_decode_step.py", tmp_path, "--device", "cpu", "--model", "tiny", "--layers", "2",
        "--batches", "2", "--hot", "0.5", "--context", "32", "--trace", "zipf", "--trace-steps", "120",
        "--trace-phase", "40",
    )  # fmt: skip
    rows = {row["placement"]: row for row in r["placements"]}
    assert set(rows) == {"uniform", "heat", "best-static"} and r["trace"]["phase_steps"] == 40
    assert rows["heat"]["hot_experts"] == 6 and rows["uniform"]["hot_experts"] == rows["heat"]["slots"] == 8
    assert all(0 < row["served_share"] < 1 and row["step_ms"] > 0 for row in rows.values())
    assert rows["best-static"]["served_share"] > rows["uniform"]["served_share"]
    assert rows["heat"]["moves_per_step"] > 0 and rows["uniform"]["moves_per_step"] == 0


@pytest.mark.slow
def test_contention_benchmark(tmp_path):
    """The engine on every core beside a busy process: no call stalls for a scheduler slice (on the
    2-core Xeon, before waiting workers pulled preempted ones onto their cores: 21-22x the median
    alone in every run of 300 calls; after: 1.8-8.8x in 600)."""
    # The stall it guards against came back in every run; a VM's single hiccup (one call of 27 ms
    # beside a 0.9 ms median, once in a CI run) does not: a second run decides.
    for _ in range(2):
        r = run_bench("bench_contention.py", tmp_path, "--calls", "200", "--busy", "1")
        for part in ("alone", "beside_busy"):
            s = r[part]
            assert 0 < s["median_ms"] <= s["p90_ms"] <= s["worst_ms"]
        assert r["busy"] == 1 and r["threads"] >= 1
        if r["beside_busy"]["worst_ms"] < 15 * r["alone"]["median_ms"]:
            return
    raise AssertionError(f"a call beside a busy process stalled in two runs: {r}")


@pytest.mark.slow
def test_load_benchmark(tmp_path):
    r = run_bench(
        "bench_load.py",
        tmp_path,
        "--shape",
        "1024",
        "512",
        "16",
        "--layers",
        "2",
        "--gguf-type",
        "Q8_0",  # blocks of 32: the K-quants' 256 exceed I
        "--workdir",
        str(tmp_path / "w"),
    )
    assert r["shape"] == [1024, 512, 16] and len(r["rows"]) == 16  # 4 sources x 2 hot shares x cold/warm
    held = {row["hot_fraction"]: row["packed_mib"] for row in r["rows"]}
    assert held[0.25] == pytest.approx(0.75 * held[0.0])  # the hot experts are not held
    rows = {(row["source"], row["hot_fraction"], row["cache"]): row for row in r["rows"]}
    for (source, hot, cache), row in rows.items():
        assert row["within_bound"] and row["decode_ms"] > 0
        # a packed directory's layer computes from the file's pages; the others from their own copy
        mapped = source == "converted directory, packed layout"
        assert row["computes_from_file"] == mapped
        assert (row["mapped_mib"] if mapped else row["final_mib"]) >= 0.9 * row["packed_mib"]
        if mapped:  # no copy of its own: less anonymous memory than the same layers repacked at load
            repacked = rows[("converted directory", hot, cache)]
            assert row["final_mib"] <= repacked["final_mib"] - 0.5 * row["packed_mib"]


def test_amx_kernel_benchmark_on_the_tile_model(tmp_path):
    """The per-core AMX kernel benchmark runs on the tile unit's model (timings there mean nothing;
    the device check runs it on the tile unit)."""
    from kt_sglang.engine.native import _native

    if "amx-emu" not in _native.supported_isas():
        pytest.skip("the modelled AMX kernels need AVX-512 with VNNI, BF16 and VBMI")
    r = run_bench(
        "bench_amx_kernels.py", tmp_path, "--isa", "amx-emu", "--shapes", "qwen3-down",
        "--rows", "64", "--calls", "1",
    )  # fmt: skip
    point = r["points"]["qwen3-down/m64"]
    assert r["isa"] == "amx-emu" and r["group"] == 64
    assert set(point) == {
        "int4-group",
        "int4-whole-k",
        "int4-a16",
        "int8-group",
        "bf16",
        "whole_k_over_group",
    }
    assert all(v > 0 for v in point.values())
