"""The real SGLang server with the kt-sglang plugin, end to end, against HF transformers' generate.

The tiny models have decisive routing (see kt_sglang/tiny_model.py), so bf16 cannot flip an expert
choice. Greedy next-token margins are what they are: the comparison uses prompts whose float32 HF
continuation never has a top-2 logit gap below MIN_MARGIN (3x the largest bf16-vs-float32 logit
difference measured on these models), and then demands identical ids.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kt_sglang.cli.server import CPU_DEVICE_ARGS, SGLangServer, free_port, server_command
from kt_sglang.layer.hf import replace_experts
from kt_sglang.tiny_model import TinyMoESpec, write_tiny_moe

MIN_MARGIN = 0.04
LOGPROB_TOL = 0.03  # bf16 serving vs the float32 stack; deferring one expert moves them by up to ~0.1
NEW_TOKENS = 8


def _hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def _standalone_model(model_dir, method: str, hot: int, deferred: int):
    """HF's model (float32) with every MoE layer replaced by our standalone layer stack: the same
    engine, quantized weights, hot experts 0..hot-1 (uniform placement) and deferral chain as the
    server, deferring at every batch size (the server: `--kt-deferral-max-batch` below)."""
    model = _hf_model(model_dir)
    replace_experts(model, model_dir, method, hot, deferred, deferral_max_tokens=None)
    return model


def _reference(model, candidates: int = 64, wanted: int = 4) -> list[tuple[list[int], list[int]]]:
    gen = torch.Generator().manual_seed(0)
    picked = []
    for _ in range(candidates):
        ids = torch.randint(3, model.config.vocab_size, (6,), generator=gen).tolist()
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
        top2 = torch.stack([s[0].topk(2).values for s in out.scores])
        if (top2[:, 0] - top2[:, 1]).min() >= MIN_MARGIN:
            picked.append((ids, out.sequences[0, len(ids) :].tolist()))
        if len(picked) == wanted:
            break
    assert len(picked) >= 2, "too few prompts with well separated logits: the tiny model changed"
    return picked


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = write_tiny_moe(tmp_path_factory.mktemp("qwen3moe"), TinyMoESpec(arch="qwen3_moe"))
    return path, _reference(_hf_model(path))


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    path = write_tiny_moe(tmp_path_factory.mktemp("mixtral"), TinyMoESpec(arch="mixtral", num_layers=2))
    return path, _reference(_hf_model(path))


def _serve_and_generate(model_dir, kt_args: list[str], prompts, log_path, logprobs: list | None = None):
    """Greedy ids of each prompt (and, into ``logprobs``, the server's log-probability of each)."""
    port = free_port()
    cmd = server_command(model_dir, CPU_DEVICE_ARGS + kt_args, port)
    with SGLangServer(cmd, log_path, port) as server:
        outs = []
        for ids, _ in prompts:
            r = server.post(
                "/generate",
                {
                    "input_ids": ids,
                    "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
                    "return_logprob": True,
                },
            )
            outs.append(r["output_ids"])
            if logprobs is not None:
                logprobs.append([lp for lp, *_ in r["meta_info"]["output_token_logprobs"]])
        return outs, server.log_tail(400)


def _chosen_logprobs(model, prompts) -> torch.Tensor:
    """Log-probability of each continuation token under ``model`` (teacher forcing) ``[P, NEW_TOKENS]``."""
    rows = []
    with torch.no_grad():
        for ids, cont in prompts:
            seq = torch.tensor([ids + cont])
            logp = torch.log_softmax(model(seq).logits[0, len(ids) - 1 : -1].float(), -1)
            rows.append(logp[torch.arange(len(cont)), torch.tensor(cont)])
    return torch.stack(rows)


def _kt(model_dir, method="BF16", gpu_experts=0, deferred=0) -> list[str]:
    return [
        "--kt-weight-path",
        str(model_dir),
        "--kt-method",
        method,
        "--kt-cpuinfer",
        "2",
        "--kt-num-gpu-experts",
        str(gpu_experts),
        "--kt-max-deferred-experts-per-token",
        str(deferred),
    ]


@pytest.mark.parametrize(
    "gpu_experts, placement", [(0, "uniform"), (3, "uniform"), (8, "uniform"), (3, "random")]
)
def test_qwen3_moe_bf16_greedy_ids_equal_hf(qwen, gpu_experts, placement, tmp_path):
    """Random placement puts hot experts in slots other than their ids: a wrong slot changes ids."""
    model_dir, prompts = qwen
    args = _kt(model_dir, "BF16", gpu_experts) + ["--kt-expert-placement-strategy", placement]
    outs, log = _serve_and_generate(model_dir, args, prompts, tmp_path / "server.log")
    # the plugin ran in the worker: our wrapper built the layers (else the load hook fails the server)
    assert f"hot experts per MoE layer {gpu_experts} ({placement} placement)" in log
    assert outs == [hf for _, hf in prompts]


def test_qwen3_moe_heat_placement_greedy_ids_equal_hf(qwen, tmp_path):
    """Placement by heat in the server: experts move between forward steps (re-chosen after each),
    and the greedy ids stay HF's."""
    model_dir, prompts = qwen
    args = _kt(model_dir, "BF16", 3) + ["--kt-expert-placement-strategy", "heat"]
    args += ["--kt-heat-interval-steps", "1", "--kt-heat-half-life-steps", "4"]
    outs, log = _serve_and_generate(model_dir, args, prompts, tmp_path / "server.log")
    assert "hot experts per MoE layer 3 (heat placement)" in log
    assert "kt-sglang: placement by heat: " in log  # the first moves were committed
    assert outs == [hf for _, hf in prompts]


def test_mixtral_bf16_greedy_ids_equal_hf(mixtral, tmp_path):
    model_dir, prompts = mixtral
    outs, log = _serve_and_generate(model_dir, _kt(model_dir, "BF16", 3), prompts, tmp_path / "server.log")
    assert "kt-sglang: CPU experts on, method BF16" in log
    assert outs == [hf for _, hf in prompts]


@pytest.mark.parametrize(
    "method, hot, deferred",
    [("AMXINT8", 2, 0), ("AMXINT4", 2, 0), ("BF16", 2, 1), ("AMXINT4", 3, 1), ("FP8", 2, 0)],
)
def test_qwen3_moe_server_equals_standalone_stack(qwen, method, hot, deferred, tmp_path, record_property):
    """Quantized methods and deferral: identical ids to HF's model run through our standalone layer
    stack with the same weights and semantics; agreement with plain HF (float32) is reported."""
    model_dir, hf_prompts = qwen
    standalone = _standalone_model(model_dir, method, hot, deferred)
    prompts = _reference(standalone)
    args = _kt(model_dir, method, hot, deferred) + ["--kt-deferral-max-batch", "1000000"]
    logprobs: list = []
    outs, log = _serve_and_generate(model_dir, args, prompts + hf_prompts, tmp_path / "server.log", logprobs)
    assert f"deferred per token {deferred}" in log
    assert outs[: len(prompts)] == [ids for _, ids in prompts]
    # The numbers too: the server's log-probabilities follow the stack with the same deferral, and
    # the bound separates it from the same stack without deferral.
    served = torch.tensor(logprobs[: len(prompts)])
    assert (served - _chosen_logprobs(standalone, prompts)).abs().max() < LOGPROB_TOL
    if deferred:
        undeferred = _chosen_logprobs(_standalone_model(model_dir, method, hot, 0), prompts)
        assert (served - undeferred).abs().max() > LOGPROB_TOL
    hf_out = outs[len(prompts) :]
    same = sum(ref == out for (_, ref), out in zip(hf_prompts, hf_out, strict=True))
    record_property("hf_identical_continuations", f"{same}/{len(hf_prompts)}")
    print(f"{method} hot={hot} deferred={deferred}: {same}/{len(hf_prompts)} continuations as float32 HF")


def test_qwen3_moe_gpu_prefill_keeps_the_greedy_ids(qwen, tmp_path):
    """--kt-gpu-prefill-token-threshold 16 on the CPU device (the streaming path's torch twins):
    prompts of 8 / 64 / 390 tokens, the last in chunks of 128 whose tail of 6 tokens falls below the
    threshold, give the ids of the same server without the flag."""
    from transformers import AutoConfig

    model_dir, _ = qwen
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = [(torch.randint(3, vocab, (n,), generator=gen).tolist(), None) for n in (8, 64, 390)]
    base = _kt(model_dir, "BF16", 2) + ["--chunked-prefill-size", "128"]
    engine, _ = _serve_and_generate(model_dir, base, prompts, tmp_path / "engine.log")
    args = base + ["--kt-gpu-prefill-token-threshold", "16"]
    streamed, log = _serve_and_generate(model_dir, args, prompts, tmp_path / "streamed.log")
    assert "GPU prefill from 16 tokens" in log
    assert streamed == engine


def _expert_weights(model_dir: Path):
    """The tiny model's expert matrices [N, K] (float32) by tensor name."""
    from safetensors import safe_open

    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                if ".experts." in name and name.endswith(".weight"):
                    yield name, f.get_tensor(name).float()


def _pack_nibbles_int32(q: torch.Tensor) -> torch.Tensor:
    """[R, C] values 0..15 -> int32 [R, C/8], 8 along C a word, the first least significant."""
    import numpy as np

    words = np.zeros((q.shape[0], q.shape[1] // 8), dtype=np.uint32)
    for i in range(8):
        words |= q[:, i::8].numpy().astype(np.uint32) << np.uint32(4 * i)
    return torch.from_numpy(words.view(np.int32).copy())


def _save_experts(model_dir: Path, out: Path, quantization_config: dict, tensors: dict) -> Path:
    import json

    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(out / "model.safetensors"))
    return out


def _rawint4_experts(model_dir: Path, out: Path) -> Path:
    """The tiny model's experts as a checkpoint of their own in compressed-tensors pack-quantized INT4
    (RAWINT4, Kimi-K2's format): round to nearest, symmetric, a bf16 scale per 32, packed 8 nibbles
    to an int32 with value + 8 and the first K-value least significant."""
    tensors = {}
    for name, w in _expert_weights(model_dir):
        N, K = w.shape
        groups = w.reshape(N, K // 32, 32)
        scale = (groups.abs().amax(-1) / 7).clamp_min(1e-8).bfloat16()
        q = (groups / scale.float()[..., None]).round().clamp(-8, 7).reshape(N, K).to(torch.int64) + 8
        base = name.removesuffix(".weight")
        tensors[base + ".weight_packed"] = _pack_nibbles_int32(q)
        tensors[base + ".weight_scale"] = scale
        tensors[base + ".weight_shape"] = torch.tensor([N, K], dtype=torch.int32)
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
    config = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*mlp.gate$"],
    }
    return _save_experts(model_dir, out, config, tensors)


def _gptq_experts(model_dir: Path, out: Path) -> Path:
    """The tiny model's experts as a GPTQ checkpoint (AutoGPTQ's "gptq" format): round to nearest,
    asymmetric, an fp16 scale and a zero point per 32; `qweight` W^T packed 8 nibbles along K to an
    int32, `qzeros` zero - 1 packed along N, `g_idx` in order."""
    tensors = {}
    for name, w in _expert_weights(model_dir):
        N, K = w.shape
        groups = w.reshape(N, K // 32, 32)
        lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp_min(1e-8).half()
        zero = (-lo / scale.float()).round().clamp(1, 15).to(torch.int64)
        q = (groups / scale.float()[..., None]).round() + zero[..., None]
        q = q.clamp(0, 15).reshape(N, K).to(torch.int64)
        base = name.removesuffix(".weight")
        tensors[base + ".qweight"] = _pack_nibbles_int32(q).t().contiguous()
        tensors[base + ".qzeros"] = _pack_nibbles_int32((zero - 1).t().contiguous())
        tensors[base + ".scales"] = scale.t().contiguous()
        tensors[base + ".g_idx"] = (torch.arange(K) // 32).int()
    config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False}
    return _save_experts(model_dir, out, config | {"checkpoint_format": "gptq"}, tensors)


E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def _nvfp4_experts(model_dir: Path, out: Path) -> Path:
    """The tiny model's experts as a ModelOpt NVFP4 checkpoint: e2m1 codes (two a byte, the low
    nibble first), an e4m3 scale per 16 and an fp32 `weight_scale_2` per matrix, round to nearest."""
    tensors = {}
    for name, w in _expert_weights(model_dir):
        N, K = w.shape
        g = w.abs().amax() / (448 * 6)
        blocks = w.reshape(N, K // 16, 16)
        scale = (blocks.abs().amax(-1) / 6 / g).to(torch.float8_e4m3fn)
        s = scale.float().clamp_min(2**-9) * g
        codes = ((blocks / s[..., None])[..., None] - E2M1).abs().argmin(-1).reshape(N, K).to(torch.uint8)
        base = name.removesuffix(".weight")
        tensors[base + ".weight"] = codes[:, 0::2] | (codes[:, 1::2] << 4)
        tensors[base + ".weight_scale"] = scale
        tensors[base + ".weight_scale_2"] = g.reshape(())
        tensors[base + ".input_scale"] = torch.tensor(1.0)
    return _save_experts(
        model_dir, out, {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}, tensors
    )


@pytest.mark.parametrize(
    ("method", "write"),
    [("RAWINT4", _rawint4_experts), ("GPTQ_INT4", _gptq_experts), ("NVFP4", _nvfp4_experts)],
    ids=["rawint4", "gptq-int4", "nvfp4"],
)
def test_qwen3_moe_serves_a_checkpoint_as_it_ships(qwen, method, write, tmp_path):
    """--kt-method RAWINT4 / GPTQ_INT4 / NVFP4 with --kt-weight-path at the experts' checkpoint in that
    format: the server's ids and log-probabilities follow our standalone stack on that checkpoint's
    own values."""
    model_dir, _ = qwen
    checkpoint = write(model_dir, tmp_path / method.lower())
    standalone = _hf_model(model_dir)
    replace_experts(standalone, checkpoint, method)
    prompts = _reference(standalone)
    args = _kt(model_dir, method)
    args[args.index("--kt-weight-path") + 1] = str(checkpoint)
    logprobs: list = []
    outs, _ = _serve_and_generate(model_dir, args, prompts, tmp_path / "server.log", logprobs)
    assert outs == [ids for _, ids in prompts]
    served = torch.tensor(logprobs)
    assert (served - _chosen_logprobs(standalone, prompts)).abs().max() < LOGPROB_TOL
    # and they are the checkpoint's values, not the bf16 model's the server loads its attention from
    assert (served - _chosen_logprobs(_hf_model(model_dir), prompts)).abs().max() > LOGPROB_TOL


@pytest.fixture(scope="module")
def qwen_256(tmp_path_factory):
    """A tiny Qwen3-MoE whose hidden and expert sizes are multiples of the K-quants' 256."""
    spec = TinyMoESpec(arch="qwen3_moe", num_layers=2, hidden_size=256, moe_intermediate_size=256)
    return write_tiny_moe(tmp_path_factory.mktemp("qwen3moe-256"), spec)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_qwen3_moe_serves_a_gguf_model(qwen_256, qtype, tmp_path):
    """--kt-method LLAMAFILE with --kt-weight-path at a GGUF file of the experts (written with the gguf
    package): the server's ids and log-probabilities follow our standalone stack on the same file."""
    from gguf import GGMLQuantizationType
    from gguf_files import gguf_from_checkpoint

    model_dir = qwen_256
    path = tmp_path / f"experts-{qtype}.gguf"
    gguf_from_checkpoint(model_dir, path, GGMLQuantizationType[qtype])
    standalone = _hf_model(model_dir)
    replace_experts(standalone, path, "LLAMAFILE")
    prompts = _reference(standalone)
    args = _kt(model_dir, "LLAMAFILE")
    args[args.index("--kt-weight-path") + 1] = str(path)
    logprobs: list = []
    outs, log = _serve_and_generate(model_dir, args, prompts, tmp_path / "server.log", logprobs)
    assert outs == [ids for _, ids in prompts]
    assert (torch.tensor(logprobs) - _chosen_logprobs(standalone, prompts)).abs().max() < LOGPROB_TOL


@pytest.mark.parametrize("method", ["AMXINT8", "AMXINT4"])
def test_qwen3_moe_serves_a_kt_kernel_directory(qwen_256, method, tmp_path):
    """A kt-kernel user's command unchanged: --kt-method AMXINT8 / AMXINT4 --kt-weight-path at the
    directory kt-kernel 0.7.2 itself converted (its raw .kt layout, two NUMA parts; 3 hot experts):
    the server's ids and log-probabilities follow our standalone stack on the same directory."""
    import os

    python = os.environ.get("KT_SGLANG_KT_KERNEL_PYTHON")
    if not python:
        pytest.skip(
            "needs KT_SGLANG_KT_KERNEL_PYTHON, a Python that imports kt-kernel 0.7.2: .ci/run sets it"
        )
    if "avx512bw" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("kt-kernel's AMXINT8 / AMXINT4 layers need AVX-512 (F, BW), which this CPU lacks")
    model_dir, converted = qwen_256, tmp_path / "kt-kernel"
    converted.mkdir()
    worker = Path(__file__).with_name("kt_kernel_dirs_worker.py")
    done = subprocess.run(
        [python, str(worker), "convert", str(model_dir), str(converted), method, "2"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    standalone = _hf_model(model_dir)
    replace_experts(standalone, converted, method, hot=3)
    prompts = _reference(standalone)
    args = _kt(model_dir, method, gpu_experts=3)
    args[args.index("--kt-weight-path") + 1] = str(converted)
    logprobs: list = []
    outs, log = _serve_and_generate(model_dir, args, prompts, tmp_path / "server.log", logprobs)
    assert outs == [ids for _, ids in prompts]
    # kt-kernel's numerics quantize each token's input with one int8 scale over all of K: a step of
    # max|x| / 127, which the bf16 serving's inputs cross more often than a group's finer steps
    tol = 0.05
    assert (torch.tensor(logprobs) - _chosen_logprobs(standalone, prompts)).abs().max() < tol


def _expert_adapter(model_dir: Path, out: Path) -> Path:
    """A LoRA adapter of the tiny model's routed experts (random, B != 0), saved in PEFT's format."""
    from kt_sglang.finetune.hf import attach_lora_experts, save_expert_adapter

    modules = attach_lora_experts(_hf_model(model_dir), rank=4, alpha=8.0, seed=3)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for m in modules.values():
            for p in (m.gate_lora_b, m.up_lora_b, m.down_lora_b):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return save_expert_adapter(modules, out)


def _merged_model(model_dir: Path, adapter_dir: Path):
    """HF's model (float32) with the adapter merged into every expert."""
    from kt_sglang.finetune.adapter import ExpertAdapter

    model = _hf_model(model_dir)
    adapter, cfg = ExpertAdapter(adapter_dir), model.config
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            experts = layer.mlp.experts
            E, H, I = experts.down_proj.shape
            gate, up, down = adapter.deltas(i, list(range(E)), E, H, I)
            experts.gate_up_proj += torch.cat([gate, up], dim=1)
            experts.down_proj += down
    assert cfg.num_experts == E
    return model


def test_qwen3_moe_serves_an_expert_adapter(qwen, tmp_path):
    """--kt-expert-lora-path: the adapter merged into the CPU experts and the hot ones; the server's
    greedy ids and log-probabilities follow HF's float32 model with the adapter merged, and differ
    from the base model's."""
    model_dir, base_prompts = qwen
    adapter = _expert_adapter(model_dir, tmp_path / "adapter")
    merged = _merged_model(model_dir, adapter)
    prompts = _reference(merged)
    logprobs: list = []
    args = [*_kt(model_dir, "BF16", gpu_experts=2), "--kt-expert-lora-path", str(adapter)]
    outs, _ = _serve_and_generate(model_dir, args, prompts, tmp_path / "server.log", logprobs)
    assert outs == [ids for _, ids in prompts]
    served = torch.tensor(logprobs)
    assert (served - _chosen_logprobs(merged, prompts)).abs().max() < LOGPROB_TOL
    assert (served - _chosen_logprobs(_hf_model(model_dir), prompts)).abs().max() > 10 * LOGPROB_TOL


def _launch_error(args: list[str]) -> subprocess.CompletedProcess:
    cmd = server_command(args[0], CPU_DEVICE_ARGS + args[1:], free_port())
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=args[0])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--kt-method", "LLAMAFILE"], "--kt-method LLAMAFILE reads GGUF models"),
        (["--kt-method", "INT3"], "unknown method 'INT3'"),
        (["--kt-num-gpu-experts", "9"], "--kt-num-gpu-experts 9 is more than the model's 8 experts"),
        (["--kt-max-deferred-experts-per-token", "2"], "use 0..1"),
        (["--kt-deferral-max-batch", "-1"], "--kt-deferral-max-batch -1: use 0 or more"),
        (["--kt-threadpool-count", "2"], "NUMA node(s); use 1..1"),
        (["--kt-expert-placement-strategy", "frequency"], "frequency needs --kt-placement-stats"),
        (["--kt-numa-nodes", "7"], "--kt-numa-nodes names node(s) [7] that this machine lacks"),
        (["--kt-cpuinfer", "0"], "--kt-cpuinfer 0: this machine has"),
        (
            ["--kt-gpu-prefill-token-threshold", "many"],
            "--kt-gpu-prefill-token-threshold 'many': give a number",
        ),
        (
            ["--kt-gpu-prefill-buffer-gib", "1"],
            "--kt-gpu-prefill-buffer-gib needs --kt-gpu-prefill-token-threshold",
        ),
        (
            ["--kt-expert-lora-path", "/nonexistent"],
            "--kt-expert-lora-path: /nonexistent is not a PEFT adapter",
        ),
        (
            [
                "--kt-expert-placement-strategy",
                "heat",
                "--kt-num-gpu-experts",
                "2",
                "--kt-heat-max-moves",
                "0",
            ],
            "--kt-heat-max-moves 0: use an integer >= 1",
        ),
        (["--kt-gpu-experts-memory-gib", "-2"], "--kt-gpu-experts-memory-gib -2.0: use a number of GiB > 0"),
    ],
)
def test_bad_flags_stop_the_launcher_with_one_message(qwen, flags, message):
    model_dir, _ = qwen
    r = _launch_error([str(model_dir), "--kt-weight-path", str(model_dir), *flags])
    assert r.returncode == 2, r.stderr[-2000:]
    assert message in r.stderr
    assert "Traceback" not in r.stderr


def test_sglang_serve_entry_point_loads_the_plugin(qwen, tmp_path):
    """`sglang serve` (SGLang's recommended entry point) checks our flags as launch_server does."""
    model_dir, _ = qwen
    exe = str(Path(sys.executable).parent / "sglang")
    args = ["--model-path", str(model_dir), *CPU_DEVICE_ARGS, "--kt-weight-path", str(model_dir)]
    r = subprocess.run(
        [exe, "serve", *args, "--kt-num-gpu-experts", "9"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--kt-num-gpu-experts 9 is more than the model's 8 experts" in r.stderr


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="this machine has a GPU: the message is for machines without one"
)
def test_no_gpu_without_device_cpu_says_what_to_add(qwen, tmp_path):
    model_dir, _ = qwen
    cmd = server_command(model_dir, ["--kt-weight-path", str(model_dir), "--kt-method", "BF16"], free_port())
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "no GPU (or other accelerator) found: add --device cpu" in r.stderr
    assert "Traceback" not in r.stderr


def test_weight_path_missing_or_for_another_model(qwen, mixtral, tmp_path):
    model_dir, _ = qwen
    r = _launch_error([str(model_dir), "--kt-weight-path", str(tmp_path / "nowhere")])
    assert r.returncode == 2 and "nowhere does not exist" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "file.bin").write_bytes(b"x")
    r = _launch_error([str(model_dir), "--kt-weight-path", str(tmp_path / "file.bin")])
    assert r.returncode == 2 and "file.bin is not a directory" in r.stderr and "Traceback" not in r.stderr
    other = write_tiny_moe(tmp_path / "other", TinyMoESpec(hidden_size=96))
    r = _launch_error([str(model_dir), "--kt-weight-path", str(other)])
    assert r.returncode == 2 and "is for another model" in r.stderr, r.stderr[-2000:]


def test_truncated_converted_shard_is_named_before_the_workers_start(qwen, tmp_path):
    from kt_sglang.weights.convert_cpu import main as convert_cpu

    model_dir, _ = qwen
    out = tmp_path / "int8"
    args = [
        "--input-path",
        str(model_dir),
        "--input-type",
        "bf16",
        "--output",
        str(out),
        "--quant-method",
        "INT8",
    ]
    assert convert_cpu(args) == 0
    shard = next(out.glob("experts-*.safetensors"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    r = _launch_error([str(model_dir), "--kt-weight-path", str(out), "--kt-method", "AMXINT8"])
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"cannot read {shard} (truncated or not safetensors" in r.stderr and "Traceback" not in r.stderr


def test_qwen3_moe_serves_a_packed_conversion(qwen, tmp_path):
    """--kt-weight-path at a `convert-cpu --layout packed` directory: every layer computes from its
    mapped file, and the ids and log-probabilities follow the standalone stack that quantizes the
    checkpoint on load (the same packed bytes)."""
    from kt_sglang.weights.convert_cpu import main as convert_cpu

    model_dir, _ = qwen
    out = tmp_path / "packed"
    argv = ["--input-path", str(model_dir), "--output", str(out), "--quant-method", "AMXINT4"]
    assert convert_cpu([*argv, "--layout", "packed"]) == 0
    standalone = _standalone_model(model_dir, "AMXINT4", 2, 0)
    prompts = _reference(standalone)
    args = _kt(model_dir, "AMXINT4", 2)
    args[args.index("--kt-weight-path") + 1] = str(out)
    logprobs: list = []
    outs, log = _serve_and_generate(model_dir, args, prompts, tmp_path / "server.log", logprobs)
    layers = len(list(out.glob("*.ktpack")))
    assert f"{layers} MoE layers ({layers} computed from mapped packed files)" in log
    assert outs == [ids for _, ids in prompts]
    assert (torch.tensor(logprobs) - _chosen_logprobs(standalone, prompts)).abs().max() < LOGPROB_TOL


def test_help_lists_our_flags(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--help"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    assert r.returncode == 0
    for flag in ("--kt-numa-nodes", "--kt-gpu-experts-ratio", "--kt-expert-placement-strategy"):
        assert flag in r.stdout
    assert "--kt-weight-path" in r.stdout  # SGLang's own


def test_serve_picks_flags_and_chat_streams_a_reply(qwen, tmp_path):
    import shutil

    model_dir, _ = qwen
    exe = shutil.which("kt-sglang", path=str(Path(sys.executable).parent))
    port = free_port()
    cmd = [exe, "serve", str(model_dir), "--method", "BF16", "--host", "127.0.0.1", "--port", str(port)]
    with SGLangServer(cmd, tmp_path / "serve.log", port) as server:
        log = server.log_tail(2000)
        chosen = log.splitlines()[0]  # the command it runs
        assert chosen.startswith("==> ") and "sglang.launch_server" in chosen
        for flag in ("--kt-weight-path", "--kt-cpuinfer", "--kt-threadpool-count", "--device cpu"):
            assert flag in chosen
        assert "kt-sglang: CPU experts on, method BF16" in log
        r = subprocess.run(
            [exe, "chat", "--url", server.url, "--max-tokens", "6", "--temperature", "0"],
            input="What is the capital of France?\n\n",
            capture_output=True,
            text=True,
            timeout=120,
        )
        transcript, status = _chat_in_a_terminal(
            [
                exe,
                "chat",
                "--url",
                server.url,
                "--max-tokens",
                "6",
                "--temperature",
                "0",
                "--system",
                "Be brief.",
            ],
            ["/help", "Hello", "/retry", "zqxj " * 700, "Still there?", "/clear", "/quit"],  # lines < 4 KiB
        )
    assert r.returncode == 0, r.stderr
    reply = r.stdout.split("assistant> ", 1)[1].split("\nyou> ")[0]
    assert reply.strip(), r.stdout
    assert status == 0, transcript
    assert "/retry         ask again" in transcript
    assert transcript.count("tokens/s)") == 3, transcript  # Hello, its retry, and after the error
    assert "error: the server answered 400: " in transcript and "context length" in transcript, transcript
    assert "\x1b[2m(" in transcript  # the token count is dimmed in a terminal
    assert "(conversation cleared)" in transcript
    down = subprocess.run(
        [exe, "chat", "--url", "http://127.0.0.1:9"], capture_output=True, text=True, timeout=60
    )
    assert down.returncode == 1 and "error: cannot reach http://127.0.0.1:9" in down.stderr


def _chat_in_a_terminal(command: list[str], lines: list[str], timeout_s: float = 300) -> tuple[str, int]:
    """Runs `kt-sglang chat` on a pseudo-terminal, typing each line at its prompt; (transcript, status)."""
    import os
    import pty
    import select
    import time

    master, slave = pty.openpty()
    proc = subprocess.Popen(command, stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    out = b""
    deadline = time.monotonic() + timeout_s

    def read_until_prompt() -> None:
        nonlocal out
        start = len(out)
        while b"you> " not in out[start:] and time.monotonic() < deadline and proc.poll() is None:
            ready, _, _ = select.select([master], [], [], 1)
            if ready:
                try:
                    out += os.read(master, 65536)
                except OSError:
                    return

    for line in lines:
        read_until_prompt()
        os.write(master, line.encode() + b"\n")
    status = proc.wait(timeout=max(1, deadline - time.monotonic()))
    try:
        while select.select([master], [], [], 0.2)[0]:
            out += os.read(master, 65536)
    except OSError:
        pass
    os.close(master)
    return out.decode(errors="replace"), status


def test_request_checks_name_the_problem():
    """The plugin's checks on SGLang's own request objects (the server test covers the ids and
    top log-probabilities; an empty token list comes from a tokenizer without BOS and an empty text)."""
    from types import SimpleNamespace

    from sglang.srt.managers.io_struct import GenerateReqInput

    from kt_sglang.sglang.hooks import validate_request

    manager = SimpleNamespace(model_config=SimpleNamespace(vocab_size=100))
    seen = []

    def original(manager, obj, input_ids):
        seen.append(input_ids)

    for ids, logprobs, message in (
        ([], 0, "the prompt has no tokens"),
        ([5, 100], 0, "token id 100, outside the vocabulary \\[0, 100\\)"),
        ([5, -1], 0, "token id -1"),
        ([5], 101, "top_logprobs_num 101 is more than the vocabulary's 100 tokens"),
    ):
        obj = GenerateReqInput(text="x", return_logprob=bool(logprobs), top_logprobs_num=logprobs)
        with pytest.raises(ValueError, match=message):
            validate_request(original, manager, obj, ids)
    obj = GenerateReqInput(text="x", return_logprob=True, top_logprobs_num=100)
    validate_request(original, manager, obj, [0, 99])
    assert seen == [[0, 99]]  # a valid request reaches SGLang's own checks
