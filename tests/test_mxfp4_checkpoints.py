"""MXFP4 checkpoints as gpt-oss and DeepSeek-V4-Flash ship them, read as they are.

The checkpoints are packed here with the format's own layout (two e2m1 codes a byte, the low nibble
first; e8m0 scales per 32). The gpt-oss reference is transformers' own GptOssExperts (its SwiGLU with
clamp, alpha, (up + 1) and biases) on the codes' values decoded here; DeepSeek-V4's is the float32 MoE
with its clamped SiLU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import isa_params, make_hidden, make_routing
from safetensors.torch import load_file, save_file

from kt_sglang import KTMoEWrapper
from kt_sglang.engine import Glu
from kt_sglang.engine.activation import SILU
from kt_sglang.engine.reference import moe_reference, relative_error
from kt_sglang.weights import CheckpointError
from kt_sglang.weights.checkpoint import open_checkpoint
from kt_sglang.weights.convert_cpu import main as convert_main

E, TOP_K, H, I = 8, 2, 256, 192
E2M1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]


def _codes_and_scales(N, K, gen, centre):
    """Random e2m1 codes [N, K] and e8m0 exponents [N, K/32] about 2^(centre - 127)."""
    codes = torch.randint(0, 16, (N, K), generator=gen, dtype=torch.uint8)
    exps = (torch.randint(-1, 2, (N, K // 32), generator=gen) + centre).to(torch.uint8)
    return codes, exps


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] bytes, element 2j in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _values(codes: torch.Tensor, exps: torch.Tensor) -> torch.Tensor:
    v = torch.tensor(E2M1)[codes.long()]
    return v * torch.exp2(exps.float() - 127).repeat_interleave(32, -1)


def _save(path: Path, config: dict, tensors: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(path / "model.safetensors"))
    return path


def gpt_oss_config(**kw) -> dict:
    cfg = {
        "model_type": "gpt_oss",
        "num_local_experts": E,
        "num_experts_per_tok": TOP_K,
        "experts_per_token": TOP_K,
        "hidden_size": H,
        "intermediate_size": I,
        "num_hidden_layers": 1,
        "swiglu_limit": 7.0,
        "quantization_config": {
            "quant_method": "mxfp4",
            "modules_to_not_convert": ["model.layers.*.self_attn"],
        },
    }
    cfg.update(kw)
    return cfg


def write_gpt_oss(path: Path, seed: int = 0, config: dict | None = None):
    """A gpt-oss layer 0 in its HF MXFP4 layout; returns the float32 values gate_up [E, 2I, H] (rows
    interleaved), down [E, H, I] and the biases [E, 2I], [E, H]."""
    gen = torch.Generator().manual_seed(seed)
    tensors, values = {}, {}
    # Scales near 2^-4: gate/up outputs of several units, so that the clamp at 7 is reached.
    for proj, N, K, centre in (("gate_up", 2 * I, H, 123), ("down", H, I, 122)):
        codes, exps = _codes_and_scales(N * E, K, gen, centre)
        tensors[f"model.layers.0.mlp.experts.{proj}_proj_blocks"] = _pack(codes).reshape(E, N, K // 32, 16)
        tensors[f"model.layers.0.mlp.experts.{proj}_proj_scales"] = exps.reshape(E, N, K // 32)
        values[proj] = _values(codes, exps).reshape(E, N, K)
        bias = (torch.randn(E, N, generator=gen) * 0.5).bfloat16()
        tensors[f"model.layers.0.mlp.experts.{proj}_proj_bias"] = bias
        values[proj + "_bias"] = bias.float()
    _save(path, config or gpt_oss_config(), tensors)
    return values


def _transformers_gpt_oss(values, x, ids, weights):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = GptOssConfig(
        num_local_experts=E, num_experts_per_tok=TOP_K, hidden_size=H, intermediate_size=I, swiglu_limit=7.0
    )
    experts = GptOssExperts(cfg)
    with torch.no_grad():
        experts.gate_up_proj.copy_(values["gate_up"].transpose(1, 2))
        experts.gate_up_proj_bias.copy_(values["gate_up_bias"])
        experts.down_proj.copy_(values["down"].transpose(1, 2))
        experts.down_proj_bias.copy_(values["down_bias"])
        return experts(x.float(), ids.long(), weights.float())


@pytest.mark.parametrize("isa", isa_params())
def test_gpt_oss_against_transformers(tmp_path, isa):
    values = write_gpt_oss(tmp_path / "gpt-oss")
    ckpt = open_checkpoint(tmp_path / "gpt-oss")
    assert ckpt.activation() == Glu("swiglu_oai", limit=7.0, alpha=1.702)
    assert ckpt.expert_format(0) == "mxfp4"
    layer = KTMoEWrapper(
        0, E, TOP_K, H, I, None, 2, 1, weight_path=str(ckpt.path), method="MXFP4", isa=isa,
        activation=ckpt.activation(),
    )  # fmt: skip
    layer.load_weights()
    x = make_hidden(32, H)
    gen = torch.Generator().manual_seed(4)
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(32)])
    weights = torch.softmax(torch.randn(32, TOP_K, generator=gen), -1)
    ref = _transformers_gpt_oss(values, x, ids, weights)
    g = x.float() @ values["gate_up"][0, 0::2].T
    assert (g.abs() > 7).float().mean() > 0.01  # the clamp is exercised
    assert relative_error(layer.forward(x, ids, weights), ref) <= 0.01


def test_gpt_oss_quantized_again_and_refused_by_convert_cpu(tmp_path):
    """A method that quantizes takes the dequantized values and the biases; convert-cpu refuses, as
    converted directories keep neither biases nor the activation."""
    values = write_gpt_oss(tmp_path / "gpt-oss")
    ckpt = open_checkpoint(tmp_path / "gpt-oss")
    layer = KTMoEWrapper(
        0,
        E,
        TOP_K,
        H,
        I,
        None,
        2,
        1,
        weight_path=str(ckpt.path),
        method="AMXINT8",
        activation=ckpt.activation(),
    )
    layer.load_weights()
    x = make_hidden(16, H)
    ids, wts = make_routing(16, E, TOP_K)
    assert relative_error(layer.forward(x, ids, wts), _transformers_gpt_oss(values, x, ids, wts)) <= 0.02
    # Without an activation the layer takes the checkpoint's; a conflicting one is refused.
    plain = KTMoEWrapper(0, E, TOP_K, H, I, None, 2, 1, weight_path=str(ckpt.path), method="MXFP4")
    assert plain.activation == ckpt.activation()
    plain.load_weights()
    assert relative_error(plain.forward(x, ids, wts), _transformers_gpt_oss(values, x, ids, wts)) <= 0.01
    silu = KTMoEWrapper(
        0, E, TOP_K, H, I, None, 2, 1, weight_path=str(ckpt.path), method="MXFP4", activation=SILU
    )  # fmt: skip
    with pytest.raises(CheckpointError, match="gpt_oss experts use the activation .* conflicts with"):
        silu.load_weights()
    args = ["--input-path", str(ckpt.path), "--output", str(tmp_path / "out"), "--quant-method", "MXFP4"]
    assert convert_main(args) == 2


def deepseek_v4_config(**kw) -> dict:
    cfg = {
        "model_type": "deepseek_v4",
        "n_routed_experts": E,
        "num_experts_per_tok": TOP_K,
        "hidden_size": H,
        "moe_intermediate_size": I,
        "num_hidden_layers": 2,
        "swiglu_limit": 10.0,
        "expert_dtype": "fp4",
    }
    cfg.update(kw)
    return cfg


def write_deepseek_v4(path: Path, scale_dtype=torch.float8_e8m0fnu, seed: int = 0):
    """Two MoE layers of per-expert MXFP4 under the release's names; layer 1's float32 values."""
    gen = torch.Generator().manual_seed(seed)
    tensors, values = {}, {p: [] for p in ("gate", "up", "down")}
    for layer in (0, 1):
        for e in range(E):
            for proj, w, N, K, centre in (
                ("gate", "w1", I, H, 124),
                ("up", "w3", I, H, 124),
                ("down", "w2", H, I, 122),
            ):
                codes, exps = _codes_and_scales(N, K, gen, centre)
                name = f"layers.{layer}.ffn.experts.{e}.{w}"
                tensors[name + ".weight"] = _pack(codes).view(torch.int8)
                scale = exps.view(torch.float8_e8m0fnu)
                tensors[name + ".scale"] = (
                    scale if scale_dtype != torch.float32 else torch.exp2(exps.float() - 127)
                )
                if layer == 1:
                    values[proj].append(_values(codes, exps))
    _save(path, deepseek_v4_config(), tensors)
    return tuple(torch.stack(values[p]) for p in ("gate", "up", "down"))


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("scale_dtype", [torch.float8_e8m0fnu, torch.float32], ids=["e8m0", "fp32"])
def test_deepseek_v4_against_its_own_values(tmp_path, isa, scale_dtype):
    gate, up, down = write_deepseek_v4(tmp_path / "v4", scale_dtype)
    ckpt = open_checkpoint(tmp_path / "v4")
    assert ckpt.activation() == Glu("silu", limit=10.0)
    layer = KTMoEWrapper(
        1, E, TOP_K, H, I, None, 2, 1, weight_path=str(ckpt.path), method="MXFP4", isa=isa,
        activation=ckpt.activation(),
    )  # fmt: skip
    layer.load_weights()
    x = make_hidden(24, H)
    ids, wts = make_routing(24, E, TOP_K, skip_fraction=0.1)
    assert ((x.float() @ gate[0].T).abs() > 10).float().mean() > 0.01  # the clamp is exercised
    ref = moe_reference(x, gate, up, down, ids, wts, activation=ckpt.activation())
    assert relative_error(layer.forward(x, ids, wts), ref) <= 0.01


def _rewrite(path: Path, edit) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(path / "model.safetensors"))


V4 = "layers.1.ffn.experts.5.w3"
OSS = "model.layers.0.mlp.experts.down_proj"


def _nan_scale(t):
    s = t[V4 + ".scale"].view(torch.uint8).clone()
    s[2, 1] = 255
    t[V4 + ".scale"] = s.view(torch.float8_e8m0fnu)


@pytest.mark.parametrize(
    "writer,edit,match",
    [
        ("v4", _nan_scale, "hold 255, e8m0's NaN"),
        ("v4", lambda t: t.pop(V4 + ".scale"), "w3.scale is missing"),
        ("v4", lambda t: t.update({V4 + ".scale": t[V4 + ".scale"][:, :-1]}), r"expected \[192, 8\]"),
        ("v4", lambda t: t.update({V4 + ".scale": torch.full((I, H // 32), 0.3)}), "not all powers of two"),
        ("v4", lambda t: t.update({V4 + ".weight": t[V4 + ".weight"][:, :-2]}), r"\[192, 128\]"),
        (
            "oss",
            lambda t: t.update({OSS + "_blocks": t[OSS + "_blocks"][:, :-1]}),
            r"expected uint8 \[8, 256, 6, 16\]",
        ),
        (
            "oss",
            lambda t: t.update({OSS + "_scales": t[OSS + "_scales"][..., :-1]}),
            r"expected \[8, 256, 6\]",
        ),
        (
            "oss",
            lambda t: t.update({OSS + "_bias": t[OSS + "_bias"][:, :7]}),
            r"down_proj_bias .*expected float \[8, 256\]",
        ),
    ],
    ids=[
        "nan-scale",
        "missing-scale",
        "scale-shape",
        "fp32-not-power",
        "weight-shape",
        "blocks",
        "scales",
        "bias",
    ],
)
def test_bad_mxfp4_input_is_named(tmp_path, writer, edit, match):
    path = tmp_path / writer
    if writer == "v4":
        write_deepseek_v4(path)
        layer_idx, activation = 1, Glu("silu", limit=10.0)
    else:
        write_gpt_oss(path)
        layer_idx, activation = 0, Glu("swiglu_oai", limit=7.0)
    _rewrite(path, edit)
    layer = KTMoEWrapper(
        layer_idx, E, TOP_K, H, I, None, 2, 1, weight_path=str(path), method="MXFP4", activation=activation
    )
    with pytest.raises(CheckpointError, match=match):
        layer.load_weights()
