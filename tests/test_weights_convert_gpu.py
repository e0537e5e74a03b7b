"""kt-sglang convert-gpu: llmcompressor quantizes the routed experts only; the output reloads with
transformers (compressed-tensors) with logits close to the original, and SGLang reads its config.

llmcompressor pins torch and transformers versions other than SGLang's, so the converter runs in an
environment of its own: .ci/run builds one (`pip install '.[convert-gpu]'`) and names its Python in
KT_SGLANG_CONVERT_GPU_PYTHON; the checks run here, with SGLang's transformers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kt_sglang.tiny_model import TinyMoESpec, write_tiny_moe
from kt_sglang.weights.convert_gpu import INSTALL_HINT

CALIBRATION = [
    {"text": "The quick brown fox jumps over the lazy dog."},
    {"messages": [{"role": "user", "content": "What is a mixture of experts?"}]},
    {"text": "Tokens are routed to a few experts by a small gate, and the rest stay idle."},
]


def converter_python() -> str:
    python = os.environ.get("KT_SGLANG_CONVERT_GPU_PYTHON")
    if python:
        return python
    if importlib.util.find_spec("llmcompressor") is not None:
        return sys.executable
    pytest.fail(
        "the converter tests need an environment with llmcompressor (pip install 'kt-sglang[convert-gpu]') "
        "named in KT_SGLANG_CONVERT_GPU_PYTHON: .ci/run builds one and sets it"
    )


def convert_gpu(python: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    cmd = [python, "-m", "kt_sglang.convert_gpu", *args]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, cwd=cwd
    )  # cwd: not the source tree


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("convert-gpu-models")
    calibration = root / "calibration.jsonl"
    calibration.write_text("".join(json.dumps(row) + "\n" for row in CALIBRATION))
    return {
        # Expert inputs a multiple of 128: the W4A16 / W8A16 presets quantize in groups of 128.
        "qwen3_moe": write_tiny_moe(root / "qwen", TinyMoESpec(moe_intermediate_size=128)),
        "mixtral": write_tiny_moe(root / "mixtral", TinyMoESpec(arch="mixtral", moe_intermediate_size=128)),
        "calibration": calibration,
    }


def tensor_names(directory: Path) -> list[str]:
    names = []
    for shard in sorted(directory.glob("*.safetensors")):
        with open(shard, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        names += [k for k in header if k != "__metadata__"]
    return names


def logits(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)  # the checkpoint's dtype (bf16) for both
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.mark.parametrize(
    ("arch", "method", "quant_type", "bound"),
    [
        ("qwen3_moe", "RTN", "W4A16", 0.1),
        ("qwen3_moe", "RTN", "W8A16", 0.02),
        ("qwen3_moe", "GPTQ", "W4A16", 0.1),
        ("mixtral", "RTN", "W8A16", 0.02),
    ],
)
def test_experts_quantized_and_reload_close(tmp_path, models, arch, method, quant_type, bound):
    out = tmp_path / "out"
    args = ["--model_id", str(models[arch]), "--output_dir", str(out), "--quant_method", method]
    args += ["--quant_type", quant_type, "--force_cpu"]
    if method == "GPTQ":
        args += ["--dataset", str(models["calibration"]), "--num_calibration_samples", "3"]
        args += ["--max_sequence_length", "64"]
    r = convert_gpu(converter_python(), *args, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]

    names = tensor_names(out)
    expert = "block_sparse_moe.experts.3.w1" if arch == "mixtral" else "mlp.experts.3.gate_proj"
    assert f"model.layers.1.{expert}.weight_packed" in names  # the source's names, quantized
    assert not any(".experts." in n and n.endswith(".weight") for n in names)
    for kept in ("model.layers.1.self_attn.q_proj.weight", "lm_head.weight"):
        assert kept in names  # full precision
    assert any(n.startswith("model.layers.1.") and n.endswith("gate.weight") for n in names)  # router

    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    ref, got = logits(models[arch], ids), logits(out, ids)
    rel = float((got - ref).norm() / ref.norm())
    assert 0 < rel < bound, rel

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.quantization import get_quantization_config

    config = json.loads((out / "config.json").read_text())["quantization_config"]
    scheme = get_quantization_config(config["quant_method"]).from_config(config).target_scheme_map["Linear"]
    assert (scheme["weights"].num_bits, scheme["weights"].group_size) == (int(quant_type[1]), 128)
    assert ModelConfig(str(out)).quantization == "compressed-tensors"


def test_convert_gpu_errors(tmp_path, models):
    python = converter_python()
    base = ["--model_id", str(models["qwen3_moe"]), "--force_cpu"]
    r = convert_gpu(python, *base, "--output_dir", str(tmp_path / "a"), cwd=tmp_path)
    assert r.returncode == 2 and "GPTQ needs calibration data: --dataset" in r.stderr
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "file").write_text("x")
    r = convert_gpu(python, *base, "--output_dir", str(taken), "--quant_method", "RTN", cwd=tmp_path)
    assert r.returncode == 2 and "exists and is not empty" in r.stderr
    narrow = write_tiny_moe(tmp_path / "narrow", TinyMoESpec(moe_intermediate_size=64))
    r = convert_gpu(
        python, "--model_id", str(narrow), "--output_dir", str(tmp_path / "b"), "--quant_method", "RTN",
        "--force_cpu", cwd=tmp_path,
    )  # fmt: skip
    assert (
        r.returncode == 2 and "down_proj has 64 input features, not a multiple of the W4A16 group" in r.stderr
    )
    assert not (tmp_path / "b").exists() and not (tmp_path / "b.tmp").exists()


def test_without_llmcompressor_says_how_to_install(tmp_path):
    # An interpreter where `import llmcompressor` fails, whether or not it is installed here.
    code = (
        "import sys; sys.modules['llmcompressor'] = None;"
        "from kt_sglang.weights.convert_gpu import main;"
        f"sys.exit(main(['--model_id', 'm', '--output_dir', {str(tmp_path / 'o')!r}]))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert r.returncode == 2 and INSTALL_HINT in r.stderr


def test_only_routed_experts_are_quantized():
    """The ignore list covers every other Linear of a DeepSeek / Qwen2-MoE shaped model: attention,
    router, shared experts (and Qwen2's shared-expert gate), dense MLP layers, lm_head."""
    import re

    from kt_sglang.weights.convert_gpu import full_precision_modules

    experts = [
        f"model.layers.{L}.mlp.experts.{e}.{p}_proj"
        for L in (1, 2)
        for e in range(3)
        for p in ("gate", "up", "down")
    ]
    others = [
        "lm_head",
        "model.layers.0.mlp.gate_proj",  # dense first layer
        "model.layers.0.mlp.down_proj",
        "model.layers.0.self_attn.q_a_proj",
        "model.layers.1.self_attn.kv_b_proj",
        "model.layers.1.mlp.gate",
        "model.layers.1.mlp.shared_experts.up_proj",
        "model.layers.2.mlp.shared_expert.down_proj",
        "model.layers.2.mlp.shared_expert_gate",
    ]
    ignore = full_precision_modules(experts + others)

    def ignored(name: str) -> bool:
        return any(re.fullmatch(i[3:], name) if i.startswith("re:") else i == name for i in ignore)

    assert not any(ignored(n) for n in experts)
    assert all(ignored(n) for n in others), [n for n in others if not ignored(n)]
    with pytest.raises(ValueError, match="no routed-expert Linear layers found"):
        full_precision_modules(others)
