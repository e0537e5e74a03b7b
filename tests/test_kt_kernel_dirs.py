"""kt-kernel's converted directories, read as they are: directories written by kt-kernel 0.7.2 itself
(tests/kt_kernel_dirs_worker.py, in the environment KT_SGLANG_KT_KERNEL_PYTHON names), in both of its
layouts, one and two NUMA parts, INT8 and INT4; our values against kt-kernel's quantization rule of
the bf16 weights it was given, our output against kt-kernel's own on the same directory and against a
float32 MoE of the decoded weights; partial and mismatched directories refused naming the file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kt_sglang.engine.canonical import dequantize
from kt_sglang.weights.kt_kernel_files import KtKernelDir, looks_like_kt_kernel
from kt_sglang.weights.source import CheckpointError

WORKER = Path(__file__).with_name("kt_kernel_dirs_worker.py")
# k 3840 = one K block of 3584 bytes (INT8) / 1792 bytes (INT4) and a tail; gate/up rows per part
# 768 or 384 (6 or 3 INT4 row blocks of 128, 12 or 6 INT8 ones of 64); kt-kernel needs every k of a
# part to be a multiple of 128 (INT4), which leaves row blocks no tail.
H, I, E = 3840, 768, 4
METHODS = ("AMXINT8", "AMXINT4")


def _kt_kernel_python() -> str:
    python = os.environ.get("KT_SGLANG_KT_KERNEL_PYTHON")
    if not python:
        pytest.skip(
            "needs KT_SGLANG_KT_KERNEL_PYTHON, a Python that imports kt-kernel 0.7.2: .ci/run sets it"
        )
    if "avx512bw" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("kt-kernel's AMXINT8 / AMXINT4 layers need AVX-512 (F, BW), which this CPU lacks")
    return python


def _run(*args) -> None:
    done = subprocess.run(
        [_kt_kernel_python(), str(WORKER), *map(str, args)], capture_output=True, text=True, cwd="/tmp"
    )
    if done.returncode != 0:
        if "AVX512" in done.stderr or "not available" in done.stderr:
            pytest.skip(f"kt-kernel's AMX layers need AVX-512, which this CPU lacks: {done.stderr[-200:]}")
        raise AssertionError(f"kt-kernel worker {args[0]} failed:\n{done.stderr[-3000:]}")


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[tuple[str, int], Path]:
    """kt-kernel's own raw directories: (method, NUMA parts) -> path."""
    out = {}
    for method in METHODS:
        for parts in (1, 2):
            path = tmp_path_factory.mktemp(f"{method}-{parts}")
            _run("write", path, method, parts, H, I, E, 7)
            out[method, parts] = path
    return out


def as_safetensors(raw: Path, out: Path) -> Path:
    """The layout of kt-kernel's convert_cpu_weights.py: the same bytes as safetensors tensors
    ``blk.L.ffn_{proj}_exps.E.numa.P.{weight,scale}``, beside the model's other tensors, its index
    and its config.json."""
    tensors = {"model.embed_tokens.weight": torch.zeros(4, 8, dtype=torch.bfloat16)}
    for part_dir in sorted((raw / "_layer_0").iterdir()):
        part = int(part_dir.name.removeprefix("_numa_"))
        for f in part_dir.iterdir():
            type_name, proj, expert, _size, kind, _ = f.name.split("_")
            what = "scale" if kind.startswith("scale") else "weight"
            key = f"blk.0.ffn_{proj}_exps.{expert}.numa.{part}.{what}"
            dtype = torch.float32 if key.endswith("scale") else torch.int8
            tensors[key] = torch.frombuffer(bytearray(f.read_bytes()), dtype=dtype)
    out.mkdir()
    save_file(tensors, out / "model-00001-of-00001.safetensors")
    index = {"metadata": {}, "weight_map": {k: "model-00001-of-00001.safetensors" for k in tensors}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "hidden_size": H}))
    return out


def kt_kernel_codes(w: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """kt-kernel's quantization of bf16 rows (its BufferB::from_mat, in float32): (codes, scale)."""
    w = w.float()
    amax = w.abs().amax(dim=1)
    d = amax / (127.0 if method == "AMXINT8" else 112.0)
    q8 = torch.round(w * torch.where(d > 0, 1 / d, torch.zeros_like(d))[:, None]).clamp(-128, 127)
    if method == "AMXINT8":
        return q8, d
    # its round_4bit_s8: the magnitude plus 8, cut to a multiple of 16
    return torch.sign(q8) * torch.div(q8.abs() + 8, 16, rounding_mode="floor"), d * 16


@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("method", METHODS)
def test_values_are_kt_kernels(written, method, parts):
    d = KtKernelDir(written[method, parts])
    assert d.layout == "raw .kt files" and d.parts(0) == parts and d.experts(0) == E
    d.check_layer(0, H, I, E, method)
    dense = torch.load(written[method, parts] / "dense.pt")
    group = 128
    for proj, K in (("gate", H), ("up", H), ("down", I)):
        mats = d.read(0, proj, list(range(E)), H, I, group)
        for e in range(E):
            w = dense[proj][e]
            if proj == "down":  # each NUMA part quantized its own columns
                pieces = [kt_kernel_codes(c, method) for c in w.chunk(parts, dim=1)]
                codes = torch.cat([q for q, _ in pieces], dim=1)
                scale = torch.stack([s for _, s in pieces], dim=1).repeat_interleave(I // parts, dim=1)
            else:
                codes, s = kt_kernel_codes(w, method)
                scale = s[:, None].expand(-1, K)
            ours = dequantize(method, mats[e], K, group)
            theirs = codes * scale
            # fp16 scales: each value within 2^-11 of kt-kernel's; a code rounded the other way by
            # float32 arithmetic moves a value by one step, which a handful of ties may do.
            off = (ours - theirs).abs() > theirs.abs() * 2**-11 * 1.001 + 1e-12
            assert off.float().mean() < 1e-3, (proj, e, off.float().mean())
            assert ((ours - theirs).abs() <= scale * 1.01 + 1e-9).all()


def _reference(mats, x, ids, weights, method, group):
    dense = [
        torch.stack([dequantize(method, m, K, group) for m in ms])
        for ms, K in zip(mats, (H, H, I), strict=True)
    ]
    x = x.float()
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = torch.nn.functional.silu(dense[0][e] @ x[t]) * (dense[1][e] @ x[t])
            y[t] += weights[t, j] * (dense[2][e] @ h)
    return y


def test_layouts_are_detected(written, tmp_path):
    raw = written["AMXINT8", 2]
    st = as_safetensors(raw, tmp_path / "st")
    assert looks_like_kt_kernel(raw) and looks_like_kt_kernel(st)
    assert KtKernelDir(st).layout == "safetensors"
    assert not looks_like_kt_kernel(tmp_path)
    # both layouts give the same matrices
    a = KtKernelDir(raw).read(0, "down", [1, 3], H, I, 64)
    KtKernelDir(st).check_layer(0, H, I, E, "AMXINT8")
    b = KtKernelDir(st).read(0, "down", [1, 3], H, I, 64)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.weight, y.weight) and torch.equal(x.scales, y.scales)


def test_partial_and_mismatched_directories_are_refused(written, tmp_path):
    src = written["AMXINT4", 2]
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    victim = next((broken / "_layer_0" / "_numa_1").glob("INT4_down_2_*Byte_quant_.kt"))
    victim.unlink()
    with pytest.raises(CheckpointError, match=r"_numa_1/INT4_down_2_\*Byte_quant_\.kt is missing"):
        KtKernelDir(broken).check_layer(0, H, I, E, "AMXINT4")
    shutil.copy(next((src / "_layer_0" / "_numa_1").glob("INT4_down_2_*Byte_quant_.kt")), victim)
    truncated = next((broken / "_layer_0" / "_numa_0").glob("INT4_up_3_*Byte_scale_.kt"))
    truncated.write_bytes(truncated.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=f"cannot read {truncated}: it holds 100 bytes"):
        KtKernelDir(broken).check_layer(0, H, I, E, "AMXINT4")
    with pytest.raises(
        CheckpointError, match="holds kt-kernel INT4 experts .AMXINT4.; --kt-method is AMXINT8"
    ):
        KtKernelDir(src).check_layer(0, H, I, E, "AMXINT8")
    with pytest.raises(CheckpointError, match="holds 4 experts; the model has 8"):
        KtKernelDir(src).check_layer(0, H, I, 8, "AMXINT4")
    with pytest.raises(CheckpointError, match="a 384 x 2048 INT4 part needs"):
        KtKernelDir(src).check_layer(0, 2048, I, E, "AMXINT4")
    from kt_sglang import KTMoEWrapper

    with pytest.raises(CheckpointError, match="holds kt-kernel INT4 experts .AMXINT4.; method is AMXINT8"):
        KTMoEWrapper(0, E, 2, H, I, None, 1, 1, weight_path=str(src), method="MOE_INT8")
    st = as_safetensors(written["AMXINT8", 1], tmp_path / "st")
    with pytest.raises(CheckpointError, match="neither INT8 nor INT4 of a 768 x 1024 matrix"):
        KtKernelDir(st).check_layer(0, 1024, I, E, "AMXINT8")


@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("method", METHODS)
def test_directory_states_its_shape_and_method(written, tmp_path, method, parts):
    for path in (written[method, parts], as_safetensors(written[method, parts], tmp_path / "st")):
        d = KtKernelDir(path)
        assert d.sizes() == (E, H, I) and d.method() == method and d.layers == [0]


def test_the_native_reader_checks_shapes_and_buffers():
    import numpy as np

    from kt_sglang.engine.native import _native

    src = np.zeros(64 * 64, dtype=np.uint8)
    dst = torch.empty(64 * 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="rows must be a multiple of 32"):
        _native.read_kt_kernel_tiles(
            src.ctypes.data, 33 * 64, dst.data_ptr(), 33 * 64, 33, 64, 64, 3584, False
        )
    with pytest.raises(ValueError, match="buffers of 4096 and 2048 bytes for a matrix of 4096"):
        _native.read_kt_kernel_tiles(src.ctypes.data, 4096, dst.data_ptr(), 2048, 64, 64, 64, 3584, False)


@pytest.mark.parametrize("layout", ["raw", "safetensors"])
@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("method", METHODS)
def test_served_as_kt_kernel_serves_them(written, tmp_path, method, parts, layout):
    """``KTMoEWrapper(method=..., weight_path=<kt-kernel's directory>)`` as kt-kernel's users call it:
    its output against kt-kernel's own on the same directory (decode and prefill rows) and against
    a float32 MoE of the decoded weights; with GPU experts and a slot map, only the held are read."""
    from kt_sglang import KTMoEWrapper

    path = (
        written[method, parts] if layout == "raw" else as_safetensors(written[method, parts], tmp_path / "st")
    )
    for tokens in (3, 128):
        out = tmp_path / f"kt-{tokens}.pt"
        _run("forward", written[method, parts], method, parts, H, I, E, 2, tokens, 11, out)
        theirs = torch.load(out)
        layer = KTMoEWrapper(
            0, E, 2, H, I, None, 2, 1, weight_path=str(path), chunked_prefill_size=128, method=method
        )
        assert layer.group_size == 128
        layer.load_weights()
        ours = layer.forward(theirs["x"], theirs["ids"], theirs["weights"]).float()
        mats = [KtKernelDir(path).read(0, p, list(range(E)), H, I, 128) for p in ("gate", "up", "down")]
        exact = _reference(mats, theirs["x"], theirs["ids"], theirs["weights"], method, 128)
        rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
        assert layer._layer.int8_input_per_row  # kt-kernel's numerics: inputs per token / row of h
        # kt-kernel and we quantize every input row to int8 with one scale (gate/up: over all of K;
        # down: over a NUMA part's / pool's slice of h), ~0.024 of the output each; what remains
        # between the two is summation order (~0.01), h's slices where kt-kernel's parts are not our
        # pools, and for INT4 from 64 rows an expert the whole-K kernel's rounding of the weights to
        # int8 per channel (docs/engine.md)
        assert rel(ours, exact) < 0.03 and rel(theirs["y"].float(), exact) < 0.03, (tokens, rel(ours, exact))
        same_slices = parts == layer.layout.pools
        near = 0.015 if same_slices and (method == "AMXINT8" or tokens < 64) else 0.025
        assert rel(ours, theirs["y"].float()) < near, (tokens, rel(ours, theirs["y"].float()))
    # GPU experts 0 and 3 are not read; slots 1 and 2 take source experts 2 and 1
    mask = torch.tensor([True, False, False, True])
    layer = KTMoEWrapper(0, E, 2, H, I, mask, 2, 1, weight_path=str(path), method=method)
    layer.load_weights([0, 2, 1, 3])
    x, ids = theirs["x"][:4], torch.tensor([[1, 2]] * 4)
    w = torch.full((4, 2), 0.5)
    swapped = [[m[i] for i in (0, 2, 1, 3)] for m in mats]
    want = _reference(swapped, x, ids, w, method, 128)
    assert rel(layer.forward(x, ids, w).float(), want) < 0.03
