"""NVFP4 checkpoints as ModelOpt and compressed-tensors write them, read as they are.

Packed here with the format's own layout (two e2m1 codes a byte, the low nibble first; e4m3 scales
per 16; one fp32 scale per matrix, multiplied by ModelOpt and divided by compressed-tensors), and
checked against float32 on the values decoded here. Gate and up get different global scales.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import isa_params, make_hidden, make_routing
from safetensors.torch import load_file, save_file

from kt_sglang import KTMoEWrapper
from kt_sglang.engine.reference import moe_reference, relative_error
from kt_sglang.weights import CheckpointError
from kt_sglang.weights.checkpoint import open_checkpoint

E, TOP_K, H, I = 8, 2, 256, 160
E2M1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
PATTERN = "model.layers.0.mlp.experts.{e}.{proj}_proj"
GLOBALS = {"gate": 0.0625, "up": 0.03125 * 3, "down": 0.05}


def write_nvfp4(path: Path, writer: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A Qwen3-MoE layer of NVFP4 experts; their float32 values [E, N, K] per projection."""
    gen = torch.Generator().manual_seed(seed)
    tensors, values = {}, {p: [] for p in GLOBALS}
    for e in range(E):
        for proj, (N, K) in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            codes = torch.randint(0, 16, (N, K), generator=gen, dtype=torch.uint8)
            scale = ((torch.rand(N, K // 16, generator=gen) + 0.5) * 4 / K**0.5).to(torch.float8_e4m3fn)
            g = torch.tensor([GLOBALS[proj]])
            base = PATTERN.format(e=e, proj=proj)
            packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
            if writer == "modelopt":
                tensors[base + ".weight"] = packed
                tensors[base + ".weight_scale_2"] = g.reshape(())
                tensors[base + ".input_scale"] = torch.tensor(1.0)
            else:
                tensors[base + ".weight_packed"] = packed
                tensors[base + ".weight_global_scale"] = 1 / g
            tensors[base + ".weight_scale"] = scale
            s = scale.float() * (g if writer == "modelopt" else 1 / (1 / g))
            values[proj].append(torch.tensor(E2M1)[codes.long()] * s.repeat_interleave(16, 1))
    quant = (
        {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
        if writer == "modelopt"
        else {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}
    )
    config = {
        "model_type": "qwen3_moe",
        "num_experts": E,
        "num_experts_per_tok": TOP_K,
        "hidden_size": H,
        "moe_intermediate_size": I,
        "num_hidden_layers": 1,
        "quantization_config": quant,
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(path / "model.safetensors"))
    return tuple(torch.stack(values[p]) for p in GLOBALS)


def run(path: Path, method: str, weights, isa=None):
    layer = KTMoEWrapper(0, E, TOP_K, H, I, None, 2, 1, weight_path=str(path), method=method, isa=isa)
    layer.load_weights()
    x = make_hidden(24, H)
    ids, wts = make_routing(24, E, TOP_K, skip_fraction=0.1)
    return layer.forward(x, ids, wts), moe_reference(x, *weights, ids, wts)


def test_format_group_is_the_methods():
    from kt_sglang.engine.methods import METHODS, method_for_format
    from kt_sglang.weights.formats import mxfp4, nvfp4

    for fmt in (nvfp4.NVFP4, mxfp4.MXFP4, mxfp4.FUSED_MXFP4):
        assert METHODS[method_for_format(fmt.name)].allowed_groups == (fmt.group,)


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("writer", ["modelopt", "compressed-tensors"])
def test_nvfp4_against_its_own_values(tmp_path, isa, writer):
    weights = write_nvfp4(tmp_path / writer, writer)
    assert open_checkpoint(tmp_path / writer).expert_format(0) == "nvfp4"
    out, ref = run(tmp_path / writer, "NVFP4", weights, isa)
    assert relative_error(out, ref) <= 0.01


def test_nvfp4_quantized_again_for_amxint8(tmp_path):
    weights = write_nvfp4(tmp_path / "m", "modelopt")
    out, ref = run(tmp_path / "m", "AMXINT8", weights)
    assert relative_error(out, ref) <= 0.02


def _rewrite(path: Path, edit) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(path / "model.safetensors"))


BASE = PATTERN.format(e=4, proj="down")


def _nan_scale(t):
    s = t[BASE + ".weight_scale"].view(torch.uint8).clone()
    s[5, 2] = 0x7F
    t[BASE + ".weight_scale"] = s.view(torch.float8_e4m3fn)


@pytest.mark.parametrize(
    "edit,match",
    [
        (
            lambda t: t.update({BASE + ".weight_scale": t[BASE + ".weight_scale"].float()}),
            "expected float8_e4m3fn",
        ),
        (lambda t: t.update({BASE + ".weight_scale": t[BASE + ".weight_scale"][:, :-1]}), r"\[256, 9\]"),
        (
            lambda t: t.update({BASE + ".weight": t[BASE + ".weight"].view(torch.int8)}),
            "weight in model.safetensors is int8",
        ),
        (
            lambda t: t.update({BASE + ".weight_scale_2": torch.tensor(0.0)}),
            "expected a positive finite scale",
        ),
        (lambda t: t.update({BASE + ".weight_scale_2": torch.ones(2)}), "expected one fp32"),
        (_nan_scale, "expert 4 down: scales at row 5, column 2 is NaN"),
    ],
    ids=["scale-dtype", "scale-shape", "weight-dtype", "zero-global", "two-globals", "nan-scale"],
)
def test_bad_nvfp4_input_is_named(tmp_path, edit, match):
    write_nvfp4(tmp_path / "m", "modelopt")
    _rewrite(tmp_path / "m", edit)
    with pytest.raises(ValueError, match=match):
        run(tmp_path / "m", "NVFP4", (None, None, None))


def test_nvfp4_checkpoint_with_another_method_that_reads_as_is(tmp_path):
    write_nvfp4(tmp_path / "m", "compressed-tensors")
    with pytest.raises(CheckpointError, match="MXFP4 reads mxfp4 experts, and these are nvfp4; use NVFP4"):
        run(tmp_path / "m", "MXFP4", (None, None, None))
