"""FP8 checkpoints as they ship (block scales as DeepSeek-V3 / Qwen3-FP8 / MiniMax-M2, or one scale per
output channel as GLM-4.7-FP8) read by the e4m3 methods without changing a value."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import isa_params, make_hidden, make_routing, make_weights
from safetensors import safe_open
from test_weights_checkpoint import MIXTRAL, QWEN, write_checkpoint

from kt_sglang import KTMoEWrapper
from kt_sglang.engine.canonical import CanonicalMatrix
from kt_sglang.engine.methods import Method
from kt_sglang.engine.reference import moe_reference, relative_error
from kt_sglang.weights import Checkpoint, CheckpointError

# H and I both leave a partial last 128-block (704 = 5.5 blocks, 320 = 2.5 blocks).
E, K, H, I, LAYERS, T = 8, 2, 704, 320, 2, 24
E4M3_MAX = 448.0
BLOCK = 128


# ------------------------------------------------------------------------------------------------
# Tiny FP8 checkpoints, quantized and dequantized here with plain torch (independent of the engine)


def quantize_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 weight and fp32 scale per 128 x 128 block (the last blocks partial)."""
    N, Kd = w.shape
    nb, kb = -(-N // BLOCK), -(-Kd // BLOCK)
    padded = torch.zeros(nb * BLOCK, kb * BLOCK)
    padded[:N, :Kd] = w
    amax = padded.reshape(nb, BLOCK, kb, BLOCK).abs().amax(dim=(1, 3))
    scale = (amax / E4M3_MAX).clamp_min(1e-12)
    q = (w / expand_block(scale, N, Kd)).to(torch.float8_e4m3fn)
    return q, scale


def quantize_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.abs().amax(dim=1) / E4M3_MAX).clamp_min(1e-12)
    return (w / scale[:, None]).to(torch.float8_e4m3fn), scale


def expand_block(scale: torch.Tensor, N: int, Kd: int) -> torch.Tensor:
    return scale.repeat_interleave(BLOCK, 0)[:N].repeat_interleave(BLOCK, 1)[:, :Kd]


def dequantize_ref(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    N, Kd = q.shape
    s = scale.float()
    if s.dim() == 2 and s.shape[1] != 1:
        return q.float() * expand_block(s, N, Kd)
    return q.float() * s.reshape(N, 1)


# How a checkpoint stores the scales: (kind, scale tensor suffix, dtype, channel shape)
STYLES = {
    "block-fp32": ("block", "_scale_inv", torch.float32),  # DeepSeek-V3, Qwen3-FP8, MiniMax-M2
    "block-bf16": ("block", "_scale_inv", torch.bfloat16),
    "channel-fp32": ("channel", "_scale", torch.float32),  # [N]
    "channel-bf16-n1": ("channel", "_scale", torch.bfloat16),  # [N, 1], GLM-4.7-FP8 style
}


def fp8_tensors(names: dict[str, str], style: str, seed: int = 0, layers=range(LAYERS)):
    """Per-expert FP8 tensors of `layers`; returns (tensors, {layer: dequantized (gate, up, down)})."""
    kind, suffix, dtype = STYLES[style]
    tensors, deq = {}, {}
    for layer in layers:
        stacks = []
        for proj, stack in zip(("gate", "up", "down"), make_weights(E, I, H, seed=seed + layer), strict=True):
            mats = []
            for e in range(E):
                q, scale = (quantize_block if kind == "block" else quantize_channel)(stack[e])
                scale = scale.to(dtype)  # a bf16 scale is what the checkpoint holds, exactly
                if style.endswith("-n1"):
                    scale = scale[:, None]
                name = names[proj].format(layer=layer, expert=e)
                tensors[name], tensors[name + suffix] = q, scale
                mats.append(dequantize_ref(q, scale))
            stacks.append(torch.stack(mats))
        deq[layer] = tuple(stacks)
    return tensors, deq


def qwen_config(**kw) -> dict:
    cfg = {
        "model_type": "qwen3_moe",
        "num_experts": E,
        "num_experts_per_tok": K,
        "hidden_size": H,
        "moe_intermediate_size": I,
        "num_hidden_layers": LAYERS,
        "mlp_only_layers": [],
        "decoder_sparse_step": 1,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
    }
    cfg.update(kw)
    return cfg


def method_for(style: str) -> str:
    return "FP8" if STYLES[style][0] == "block" else "FP8_PERCHANNEL"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """One checkpoint per scale style (written once for the module)."""
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for i, style in enumerate(STYLES):
        tensors, deq = fp8_tensors(QWEN, style, seed=10 * i)
        out[style] = (write_checkpoint(root / style, qwen_config(), tensors), deq)
    return out


def layer(
    path: Path, method: str, layer_idx: int = 1, isa: str | None = None, experts: int = E
) -> KTMoEWrapper:
    return KTMoEWrapper(
        layer_idx, experts, K, H, I, None, 2, 1, weight_path=str(path), method=method, isa=isa
    )


def inputs(experts: int = E):
    ids, wts = make_routing(T, experts, K)
    return make_hidden(T, H), ids, wts


# ------------------------------------------------------------------------------------------------
# Loading: the checkpoint's own values, the float32 reference


@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.parametrize("isa", isa_params())
def test_fp8_checkpoint_loads_as_is(checkpoints, style, isa):
    path, deq = checkpoints[style]
    method = method_for(style)
    w = layer(path, method, isa=isa)
    w.load_weights()
    x, ids, wts = inputs()
    out = w.forward(x, ids, wts)
    err = relative_error(out, moe_reference(x, *deq[1], ids, wts))
    print(f"{style} {method} {isa}: relative error {err:.5f}")
    assert err <= 0.005
    # The same tensors through load_canonical: the engine got exactly the checkpoint's values.
    kind, suffix, _ = STYLES[style]
    ckpt = Checkpoint(path)
    mats = {}
    for proj in ("gate", "up", "down"):
        mats[proj] = []
        for e in range(E):
            name = QWEN[proj].format(layer=1, expert=e)
            scale = ckpt.source.tensor(name + suffix).float()
            scale = scale if kind == "block" else scale.reshape(-1)
            mats[proj].append(CanonicalMatrix(ckpt.source.tensor(name), scale))
    direct = layer(path, method, isa=isa)
    direct.load_canonical(mats["gate"], mats["up"], mats["down"])
    assert torch.equal(direct.forward(x, ids, wts), out)


@pytest.mark.parametrize("style", list(STYLES))
def test_native_fp8_experts_change_no_value(checkpoints, style):
    path, _ = checkpoints[style]
    kind, suffix, _ = STYLES[style]
    ckpt = Checkpoint(path)
    experts = [6, 1, 3]
    gate, up, down = ckpt.layer_native_experts(0, experts, Method(method_for(style)))
    streamed = list(ckpt.iter_native_experts(0, Method(method_for(style))))
    assert len(gate) == len(up) == len(down) == 3 and len(streamed) == E
    for proj, mats in (("gate", gate), ("up", up), ("down", down)):
        for e, m in zip(experts, mats, strict=True):
            name = QWEN[proj].format(layer=0, expert=e)
            stored_w, stored_s = ckpt.source.tensor(name), ckpt.source.tensor(name + suffix)
            assert m.weight.dtype == torch.float8_e4m3fn and m.scales.dtype == torch.float32
            assert torch.equal(m.weight.view(torch.uint8), stored_w.view(torch.uint8))
            assert torch.equal(m.scales, stored_s.float().reshape(m.scales.shape))  # bf16 -> fp32 is exact
            N, Kd = stored_w.shape
            expected = (-(-N // BLOCK), -(-Kd // BLOCK)) if kind == "block" else (N,)
            assert tuple(m.scales.shape) == expected
            s = streamed[e][("gate", "up", "down").index(proj)]
            assert torch.equal(s.weight.view(torch.uint8), m.weight.view(torch.uint8))
            assert torch.equal(s.scales, m.scales)


def test_physical_map_reads_only_the_named_experts(checkpoints):
    path, deq = checkpoints["block-fp32"]
    slots = [7, 0, 3, 3]
    w = layer(path, "FP8", experts=4)
    w.load_weights(slots)
    x, ids, wts = inputs(4)
    ref = moe_reference(x, *(t[slots] for t in deq[1]), ids, wts)
    assert relative_error(w.forward(x, ids, wts), ref) <= 0.005


def test_other_methods_still_dequantize_fp8_and_fp8_quantizes_bf16(checkpoints, tmp_path):
    # An FP8 checkpoint, block or per-channel, converted on load to an int8 method.
    for style in ("block-bf16", "channel-bf16-n1"):
        path, deq = checkpoints[style]
        w = layer(path, "AMXINT8")
        w.load_weights()
        x, ids, wts = inputs()
        assert relative_error(w.forward(x, ids, wts), moe_reference(x, *deq[1], ids, wts)) <= 0.02
    # A bf16 checkpoint with an e4m3 method: the engine quantizes it itself.
    weights = make_weights(E, I, H, seed=40)
    tensors = {
        QWEN[proj].format(layer=1, expert=e): stack[e].bfloat16()
        for proj, stack in zip(("gate", "up", "down"), weights, strict=True)
        for e in range(E)
    }
    cfg = qwen_config()
    del cfg["quantization_config"]
    path = write_checkpoint(tmp_path / "bf16", cfg, tensors)
    for method in ("FP8", "FP8_PERCHANNEL"):
        w = layer(path, method)
        w.load_weights()
        x, ids, wts = inputs()
        ref = moe_reference(x, *(t.bfloat16() for t in weights), ids, wts)
        assert relative_error(w.forward(x, ids, wts), ref) <= 0.05


def test_minimax_m2_checkpoint_loads(tmp_path):
    tensors, deq = fp8_tensors(MIXTRAL, "block-fp32", seed=50, layers=[0])
    cfg = {
        "model_type": "minimax_m2",
        "architectures": ["MiniMaxM2ForCausalLM"],
        "num_local_experts": E,
        "num_experts_per_tok": K,
        "hidden_size": H,
        "intermediate_size": I,
        "num_hidden_layers": 1,
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "float8_e4m3fn",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
        },
    }
    path = write_checkpoint(tmp_path / "minimax", cfg, tensors, shards=2)
    assert Checkpoint(path).family.family == "minimax_m2"
    w = layer(path, "FP8", layer_idx=0)
    w.load_weights()
    x, ids, wts = inputs()
    assert relative_error(w.forward(x, ids, wts), moe_reference(x, *deq[0], ids, wts)) <= 0.005


# ------------------------------------------------------------------------------------------------
# Bad inputs: each error names the tensor


def broken(tmp_path: Path, style: str, edit, config: dict | None = None) -> Path:
    tensors, _ = fp8_tensors(QWEN, style, seed=60, layers=[1])
    edit(tensors)
    return write_checkpoint(tmp_path / "broken", config or qwen_config(), tensors)


UP3 = QWEN["up"].format(layer=1, expert=3)
DOWN5 = QWEN["down"].format(layer=1, expert=5)


def load(path: Path, method: str) -> None:
    layer(path, method).load_weights()


def test_missing_scales(tmp_path):
    path = broken(tmp_path, "block-fp32", lambda t: t.pop(UP3 + "_scale_inv"))
    with pytest.raises(CheckpointError, match=rf"{UP3} is FP8 but {UP3}_scale_inv is missing, and so is"):
        load(path, "FP8")


@pytest.mark.parametrize(
    "style,method,shape,expected",
    [
        ("block-fp32", "FP8", (5, 3), r"\[6, 3\]"),  # down [704, 320]: 6 x 3 blocks
        ("channel-fp32", "FP8_PERCHANNEL", (H, 2), r"\[704\] or \[704, 1\]"),
    ],
)
def test_misshaped_scales(tmp_path, style, method, shape, expected):
    suffix = STYLES[style][1]

    def edit(t):
        t[DOWN5 + suffix] = torch.ones(shape)

    path = broken(tmp_path / style, style, edit)
    with pytest.raises(
        CheckpointError,
        match=rf"scales {DOWN5}{suffix} in model.safetensors have shape \[{shape[0]}, {shape[1]}\]; "
        rf"expected {expected}",
    ):
        load(path, method)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fnuz, torch.float8_e5m2, torch.int8])
def test_weights_not_e4m3fn(tmp_path, dtype):
    def edit(t):
        t[UP3] = t[UP3].float().to(dtype)

    path = broken(tmp_path, "block-fp32", edit)
    name = str(dtype).removeprefix("torch.")
    pattern = rf"{UP3} in model.safetensors has dtype torch.{name}; FP8 weights must be float8_e4m3fn"
    with pytest.raises(CheckpointError, match=pattern):
        load(path, "FP8")


def test_scale_dtype_and_values(tmp_path):
    def f64(t):
        t[UP3 + "_scale_inv"] = t[UP3 + "_scale_inv"].double()

    path = broken(tmp_path / "f64", "block-fp32", f64)
    with pytest.raises(
        CheckpointError, match=rf"scales {UP3}_scale_inv in model.safetensors have dtype torch.float64"
    ):
        load(path, "FP8")

    def nan(t):
        t[UP3 + "_scale_inv"][0, 0] = float("nan")

    path = broken(tmp_path / "nan", "block-fp32", nan)
    with pytest.raises(CheckpointError, match=rf"scales {UP3}_scale_inv in model.safetensors hold NaN"):
        load(path, "FP8")


def test_block_size_other_than_128(tmp_path):
    cfg = qwen_config(quantization_config={"quant_method": "fp8", "weight_block_size": [64, 64]})
    path = broken(tmp_path, "block-fp32", lambda t: None, cfg)
    with pytest.raises(CheckpointError, match=r"weight_block_size is \[64, 64\]; FP8's blocks are 128 x 128"):
        load(path, "FP8")


def test_block_checkpoint_with_the_channel_method_and_back(checkpoints):
    path, _ = checkpoints["block-fp32"]
    with pytest.raises(
        CheckpointError,
        match=r"experts.0.gate_proj.weight in model.safetensors is FP8 with block scales .*"
        r"FP8_PERCHANNEL needs per-channel scales: use FP8 for this checkpoint",
    ):
        load(path, "FP8_PERCHANNEL")
    path, _ = checkpoints["channel-bf16-n1"]
    with pytest.raises(
        CheckpointError,
        match=r"experts.0.gate_proj.weight in model.safetensors is FP8 with one scale per output channel "
        r".*FP8 needs block scales: use FP8_PERCHANNEL for this checkpoint",
    ):
        load(path, "FP8")


# ------------------------------------------------------------------------------------------------
# kt-sglang convert-cpu on FP8 checkpoints


def convert(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("kt-sglang", path=os.path.dirname(sys.executable))
    return subprocess.run([exe, "convert-cpu", *args], capture_output=True, text=True, timeout=300)


def convert_args(path: Path, out: Path, method: str, input_type: str = "fp8") -> list[str]:
    return [
        "--input-path",
        str(path),
        "--input-type",
        input_type,
        "--output",
        str(out),
        "--quant-method",
        method,
    ]


def engine_output(path: Path, method: str) -> torch.Tensor:
    w = layer(path, method)
    w.load_weights()
    return w.forward(*inputs())


@pytest.mark.parametrize("style", ["block-fp32", "channel-bf16-n1"])
def test_convert_fp8_keeps_the_checkpoint_values(tmp_path, checkpoints, style):
    path, _ = checkpoints[style]
    method = method_for(style)
    kind, suffix, dtype = STYLES[style]
    out = tmp_path / "per-layer"
    r = convert(*convert_args(path, out, method), "--no-merge-safetensor")
    assert r.returncode == 0, r.stderr
    ckpt = Checkpoint(path)
    for layer_idx in range(LAYERS):
        with safe_open(str(out / f"layer-{layer_idx:05d}.safetensors"), framework="pt") as f:
            assert len(f.keys()) == E * 3 * 2
            for e in range(E):
                for proj in ("gate", "up", "down"):
                    name = QWEN[proj].format(layer=layer_idx, expert=e)
                    weight = f.get_tensor(f"experts.{e}.{proj}.weight")
                    scales = f.get_tensor(f"experts.{e}.{proj}.scales")
                    stored_w, stored_s = ckpt.source.tensor(name), ckpt.source.tensor(name + suffix)
                    assert weight.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
                    as_bytes = weight.view(torch.uint8).numpy().tobytes()
                    assert as_bytes == stored_w.view(torch.uint8).numpy().tobytes()
                    if dtype == torch.float32 and kind == "block":  # fp32 scales: the same bytes
                        assert scales.numpy().tobytes() == stored_s.numpy().tobytes()
                    else:
                        assert torch.equal(scales, stored_s.float().reshape(scales.shape))
    merged = tmp_path / "merged"
    assert convert(*convert_args(path, merged, method)).returncode == 0
    expected = engine_output(path, method)
    assert torch.equal(engine_output(out, method), expected)
    assert torch.equal(engine_output(merged, method), expected)


def test_convert_fp8_to_int8_and_errors(tmp_path, checkpoints):
    path, _ = checkpoints["block-fp32"]
    out = tmp_path / "int8"
    r = convert(*convert_args(path, out, "int8"))
    assert r.returncode == 0, r.stderr
    assert torch.equal(engine_output(out, "AMXINT8"), engine_output(path, "AMXINT8"))
    # The wrong e4m3 method fails before anything is written.
    r = convert(*convert_args(path, tmp_path / "wrong", "FP8_PERCHANNEL"))
    assert r.returncode == 2 and "use FP8 for this checkpoint" in r.stderr, r.stderr
    assert not (tmp_path / "wrong").exists()
    r = convert(*convert_args(path, tmp_path / "bf16", "FP8", input_type="bf16"))
    assert r.returncode == 2
    assert "--input-type bf16 does not match the checkpoint: its experts are fp8" in r.stderr
