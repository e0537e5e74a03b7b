"""`--tp-size N` with CPU experts: the real SGLang server on the CPU device, one process per rank.

SGLang shards the hot experts as its own FusedMoE; rank 0 alone holds and computes the cold experts,
added before SGLang's all-reduce, so the ranks' sum is the TP-1 layer. SGLang 0.5.23's CPU backend
runs tensor parallelism once the plugin sets its environment (`cpu_tensor_parallel_environment`).
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import psutil
import pytest
import torch
from test_sglang_server import (
    MIN_MARGIN,
    NEW_TOKENS,
    _kt,
    _launch_error,
    _reference,
    _standalone_model,
)

from kt_sglang.cli.server import CPU_DEVICE_ARGS, SGLangServer, free_port, server_command
from kt_sglang.tiny_model import TinyMoESpec, write_tiny_moe


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return write_tiny_moe(tmp_path_factory.mktemp("qwen3moe_tp"), TinyMoESpec(arch="qwen3_moe"))


def _generate(server: SGLangServer, ids: list[int]) -> list[int]:
    return _generate_with_margin(server, ids)[0]


def _generate_with_margin(server: SGLangServer, ids: list[int]) -> tuple[list[int], float]:
    """Greedy ids, and the smallest gap between the two most likely tokens over the steps."""
    r = server.post(
        "/generate",
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
            "top_logprobs_num": 2,
        },
    )
    gaps = [top[0][0] - top[1][0] for top in r["meta_info"]["output_top_logprobs"]]
    return r["output_ids"], min(gaps)


def _serve(model_dir: Path, args: list[str], log: Path):
    port = free_port()
    return SGLangServer(server_command(model_dir, CPU_DEVICE_ARGS + args, port), log, port, timeout_s=600)


def _prompts(model_dir: Path, n: int, seed: int = 0) -> list[list[int]]:
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, vocab, (int(length),), generator=gen).tolist()
        for length in torch.randint(4, 40, (n,), generator=gen)
    ]


def test_tp2_equals_tp1_with_hot_experts_and_deferral_and_takes_a_soak(qwen, tmp_path):
    """BF16, 2 hot experts, 1 deferred, prompts of 16 tokens or more streamed (GPU prefill's path on
    the CPU device): the same greedy ids at TP 2 as at TP 1 for several prompts; then 36 requests in
    flight together on the TP-2 server, every one answered, repeats identical."""
    args = _kt(qwen, "BF16", 2, 1) + [
        "--kt-deferral-max-batch",
        "1000000",
        "--kt-gpu-prefill-token-threshold",
        "16",
    ]
    # Prompts whose continuation at TP 1 never has its two most likely tokens closer than
    # MIN_MARGIN: the ranks' bf16 partial sums are rounded before the all-reduce adds them, which
    # moves logits by less than that.
    with _serve(qwen, args, tmp_path / "tp1.log") as server:
        candidates = [(p, *_generate_with_margin(server, p)) for p in _prompts(qwen, 16)]
    picked = [(p, ids) for p, ids, gap in candidates if gap >= MIN_MARGIN]
    assert len(picked) >= 4, [gap for *_, gap in candidates]
    prompts, want = [p for p, _ in picked], [ids for _, ids in picked]
    with _serve(qwen, args + ["--tp-size", "2"], tmp_path / "tp2.log") as server:
        got = [_generate(server, p) for p in prompts]
        assert got == want
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            soak = list(pool.map(lambda i: _generate(server, prompts[i % len(prompts)]), range(36)))
        log = server.log_tail(2000)
    assert soak == [want[i % len(prompts)] for i in range(36)]
    assert "tensor-parallel rank 0 of 2: computes every cold expert on 2 engine threads" in log
    assert "tensor-parallel rank 1 of 2: its share of the hot experts" in log


@pytest.mark.parametrize("method, hot, deferred", [("AMXINT8", 0, 0), ("AMXINT4", 3, 1), ("FP8", 2, 0)])
def test_tp2_methods_equal_the_standalone_stack(qwen, method, hot, deferred, tmp_path):
    """Each method the tiny model serves: TP 2 gives the ids of HF's model run through our standalone
    layer stack with the same weights (which TP 1 equals: test_sglang_server.py)."""
    prompts = _reference(_standalone_model(qwen, method, hot, deferred))
    args = _kt(qwen, method, hot, deferred) + ["--kt-deferral-max-batch", "1000000", "--tp-size", "2"]
    with _serve(qwen, args, tmp_path / "server.log") as server:
        got = [_generate(server, ids) for ids, _ in prompts]
    assert got == [ids for _, ids in prompts]


def _rss_by_process(server: SGLangServer) -> dict[str, int]:
    """Resident bytes of every process of the server, by process title."""
    root = psutil.Process(server.proc.pid)
    out = {}
    for p in [root, *root.children(recursive=True)]:
        try:
            name = " ".join(p.cmdline()) if not p.cmdline()[0].startswith("sglang::") else p.cmdline()[0]
            out[f"{name[:60]} ({p.pid})"] = p.memory_info().rss
        except (psutil.NoSuchProcess, IndexError):
            pass
    return out


@pytest.mark.slow
def test_tp2_keeps_one_copy_of_the_cold_experts(tmp_path):
    """A model with 400 MB of experts: at TP 2 only rank 0's process holds them; the whole server
    grows by the second rank's own process (SGLang and torch), not by a second copy."""
    spec = TinyMoESpec(
        arch="qwen3_moe", num_layers=2, hidden_size=512, moe_intermediate_size=2048, num_experts=32
    )
    model = write_tiny_moe(tmp_path / "model", spec)
    expert_bytes = 2 * spec.num_layers * spec.num_experts * 3 * spec.hidden_size * spec.moe_intermediate_size
    args = _kt(model, "BF16", 0, 0)
    measured = {}
    for tp in (1, 2):
        with _serve(model, args + ["--tp-size", str(tp)], tmp_path / f"tp{tp}.log") as server:
            _generate(server, [5, 6, 7, 8])
            measured[tp] = _rss_by_process(server)
    ranks = {name: rss for name, rss in measured[2].items() if "scheduler" in name}
    assert len(ranks) == 2, measured[2]
    rank0 = next(rss for name, rss in ranks.items() if "TP0" in name)
    rank1 = next(rss for name, rss in ranks.items() if "TP1" in name)
    assert rank0 - rank1 > 0.8 * expert_bytes, (rank0, rank1, expert_bytes)
    growth = sum(measured[2].values()) - sum(measured[1].values())
    # the second rank's process (and the ranks' all-reduce buffers), far from a second copy
    assert growth < rank1 + 0.25 * expert_bytes, (growth, rank1, expert_bytes)
    gib = {k: v / 2**30 for k, v in (("tp1", sum(measured[1].values())), ("tp2", sum(measured[2].values())))}
    print(
        f"RSS TP1 {gib['tp1']:.2f} GiB, TP2 {gib['tp2']:.2f} GiB (rank 0 {rank0 / 2**30:.2f}, rank 1 "
        f"{rank1 / 2**30:.2f}); experts {expert_bytes / 2**30:.2f} GiB"
    )


@pytest.mark.slow
def test_tp4_on_two_cores(tmp_path):
    """Four ranks on this machine's cores (slow, correct): the ids of TP 1. The model has as many KV
    heads as ranks (SGLang's attention shards them) and an intermediate size SGLang's CPU path does
    not pad at TP 4."""
    spec = TinyMoESpec(arch="qwen3_moe", num_kv_heads=4, moe_intermediate_size=128)
    model = write_tiny_moe(tmp_path / "model", spec)
    args = _kt(model, "AMXINT4", 2, 0)
    prompts = _prompts(model, 2, seed=1)
    with _serve(model, args, tmp_path / "tp1.log") as server:
        want = [_generate(server, p) for p in prompts]
    with _serve(model, args + ["--tp-size", "4"], tmp_path / "tp4.log") as server:
        assert [_generate(server, p) for p in prompts] == want


def test_a_tp_size_the_cpu_device_pads_for_is_refused(qwen):
    """The tiny model's experts have 64 intermediate channels: SGLang's CPU path would pad them to 128
    at TP 4; the launcher says which sizes work."""
    r = _launch_error([str(qwen), "--kt-weight-path", str(qwen), "--tp-size", "4"])
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--tp-size 4 with --device cpu: SGLang pads the experts' intermediate size 64" in r.stderr
    assert "use --tp-size 2" in r.stderr


def test_heat_placement_with_tensor_parallelism_is_refused(qwen):
    r = _launch_error(
        [str(qwen), "--kt-weight-path", str(qwen), "--kt-num-gpu-experts", "2", "--tp-size", "2",
         "--kt-expert-placement-strategy", "heat"]
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--kt-expert-placement-strategy heat with --tp-size 2" in r.stderr
