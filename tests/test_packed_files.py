"""Converted directories in the engine's packed layout (`convert-cpu --layout packed`): a one-pool
layer computes from the memory-mapped file, several pools copy their slices; both equal the layer
quantized on load from the checkpoint, bit for bit, on every ISA."""

from __future__ import annotations

import gc
import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import isa_params, make_hidden, make_routing, make_weights
from test_weights_checkpoint import QWEN, per_expert, qwen_config, write_checkpoint

from kt_sglang import KTMoEWrapper
from kt_sglang.engine import SharedRunner
from kt_sglang.weights import convert_cpu
from kt_sglang.weights.canonical_files import Manifest, verify_files
from kt_sglang.weights.checkpoint import CheckpointError
from kt_sglang.weights.packed_files import packed_file, read_header

E, K, H, I = 8, 2, 256, 192  # I: three units of 64, so two pools split it unevenly
METHODS = {"int4": "AMXINT4", "int8": "AMXINT8", "bf16": "BF16"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    tensors = {}
    for layer in (1, 2):
        tensors.update(per_expert(QWEN, layer, make_weights(E, I, H, seed=40 + layer)))
    config = qwen_config(num_experts=E, num_experts_per_tok=K, hidden_size=H, moe_intermediate_size=I)
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen", config, tensors)


def convert_packed(checkpoint: Path, out: Path, quant: str, *extra: str) -> Path:
    argv = ["--input-path", str(checkpoint), "--output", str(out), "--quant-method", quant]
    assert convert_cpu.main([*argv, "--layout", "packed", *extra]) == 0
    return out


@pytest.fixture(scope="module")
def packed(checkpoint, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("packed")
    return {q: convert_packed(checkpoint, root / q, q) for q in METHODS}


def layer(path: Path, method: str, pools: int = 1, mask=None, isa=None) -> KTMoEWrapper:
    nodes = [0] * pools if pools > 1 else None
    return KTMoEWrapper(
        2, E, K, H, I, mask, 2, pools, weight_path=str(path), method=method, numa_nodes=nodes, isa=isa
    )


def run(w: KTMoEWrapper, slots=None, T: int = 20) -> torch.Tensor:
    w.load_weights(slots)
    x = make_hidden(T, H)
    ids, wts = make_routing(T, E, K)
    return w.forward(x, ids, wts)


def mapped_files() -> str:
    return Path("/proc/self/maps").read_text()


@pytest.mark.parametrize("quant", METHODS)
@pytest.mark.parametrize("pools", [1, 2])
def test_packed_dir_equals_quantize_on_load(checkpoint, packed, quant, pools):
    method = METHODS[quant]
    assert sorted(p.name for p in packed[quant].iterdir()) == [
        "kt_weights.json",
        "layer-00001.ktpack",
        "layer-00002.ktpack",
    ]
    expected = run(layer(checkpoint, method, pools))
    SharedRunner.reset()
    w = layer(packed[quant], method, pools)
    assert torch.equal(run(w), expected)
    path = str(packed[quant] / packed_file(2))
    # one pool computes from the file's pages; several copy their slices and let the file go
    assert w.mapped == (pools == 1)
    assert (path in mapped_files()) == (pools == 1)
    del w
    gc.collect()
    assert path not in mapped_files()


@pytest.mark.parametrize("isa", isa_params())
def test_one_file_serves_every_isa(checkpoint, packed, isa):
    expected = run(layer(checkpoint, "AMXINT4", isa=isa))
    w = layer(packed["int4"], "AMXINT4", isa=isa)
    assert torch.equal(run(w), expected) and w.mapped


@pytest.mark.parametrize("pools", [1, 2])
def test_physical_map_and_gpu_experts(checkpoint, packed, pools):
    """Slots take file experts in any order (twice too), and the GPU's experts are not read."""
    slots = [5, 5, 0, 7, 1, 2, 3, 6]
    mask = torch.tensor([False, True, False, False, True, False, False, False])
    expected = run(layer(checkpoint, "AMXINT8", pools, mask=mask.clone()), slots)
    SharedRunner.reset()
    w = layer(packed["int8"], "AMXINT8", pools, mask=mask.clone())
    assert torch.equal(run(w, slots), expected)


def test_export_from_two_pools_equals_the_file(checkpoint, packed):
    w = layer(checkpoint, "AMXINT4", pools=2)
    w.load_weights()
    path = packed["int4"] / packed_file(2)
    h = read_header(path)
    data = np.fromfile(path, np.uint8)
    gate_up, down = np.empty(h.gate_up_bytes, np.uint8), np.empty(h.down_bytes, np.uint8)
    for e in range(E):
        w.export_packed(e, gate_up, down)
        assert np.array_equal(gate_up, data[h.gate_up_offset + e * h.gate_up_bytes :][: h.gate_up_bytes])
        assert np.array_equal(down, data[h.down_offset + e * h.down_bytes :][: h.down_bytes])
    with pytest.raises(ValueError, match="writable contiguous uint8 buffer of"):
        w.export_packed(0, gate_up[:-1], down)


def test_converting_in_a_process_with_two_pools_writes_the_same_file(checkpoint, packed, tmp_path):
    """The packing layer takes the pools a process already runs (a library user's), and their
    slices gather into the same file."""
    layer(checkpoint, "AMXINT4", pools=2)  # starts two pools
    out = convert_packed(checkpoint, tmp_path / "p", "int4")
    for name in (packed_file(1), packed_file(2)):
        assert (out / name).read_bytes() == (packed["int4"] / name).read_bytes()


def test_mapped_layer_loads_nothing_else(packed):
    w = layer(packed["int8"], "AMXINT8")
    w.load_weights()
    gate, up, down = make_weights(E, I, H, seed=1)
    with pytest.raises(RuntimeError, match="computes from a mapped packed file"):
        w.load_weights_from_tensors(gate, up, down)


def test_rerun_is_byte_identical_and_removes_leftovers(checkpoint, tmp_path):
    out = convert_packed(checkpoint, tmp_path / "p", "int4")
    digest = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.iterdir()}
    (out / packed_file(2)).unlink()
    (out / (packed_file(1) + ".tmp")).write_bytes(b"\0" * 100)  # a killed run's
    convert_packed(checkpoint, out, "int4")
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.iterdir()} == digest
    manifest = Manifest.read(out)
    assert manifest.layout == "packed"
    verify_files(out, manifest)
    # another layout into the same directory is another conversion
    argv = ["--input-path", str(checkpoint), "--output", str(out), "--quant-method", "int4"]
    assert convert_cpu.main(argv) == 2


def _rewrite_header(path: Path, **changes) -> None:
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[8:16])
    header = json.loads(data[16 : 16 + length])
    header.update(changes)
    text = json.dumps(header).encode()
    assert len(text) <= length + 8
    data[8:16] = struct.pack("<Q", len(text))
    data[16 : 16 + max(length, len(text))] = text.ljust(max(length, len(text)), b" ")
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage,message",
    [
        ("truncated", r"layer-00002.ktpack is \d+ bytes; its header says \d+"),
        ("not packed", "is not a kt-sglang packed layer"),
        ("another layer", "holds layer 1 of 8 experts"),
        ("another version", r"packed layout kt-sglang-packed v99; this build reads"),
        ("another method", "in AMXINT8 group"),
        ("bad offsets", "do not fit 8 experts"),
        ("missing", "layer-00002.ktpack is missing"),
    ],
)
def test_damaged_packed_file_is_named_at_load(checkpoint, tmp_path, damage, message):
    out = convert_packed(checkpoint, tmp_path / "p", "int4")
    path = out / packed_file(2)
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:-4096])
    elif damage == "not packed":
        path.write_bytes(b"\xff" * 64 + path.read_bytes()[64:])
    elif damage == "another layer":
        path.write_bytes((out / packed_file(1)).read_bytes())
    elif damage == "another version":
        _rewrite_header(path, version=99)
    elif damage == "another method":
        _rewrite_header(path, method="AMXINT8")
    elif damage == "bad offsets":
        _rewrite_header(path, gate_up_offset=4100)  # off the cache lines; the size still agrees
    else:
        path.unlink()
    w = layer(out, "AMXINT4")
    with pytest.raises(CheckpointError, match=message):
        w.load_weights()
    if damage != "bad offsets":  # the launcher's check reads headers and sizes; the engine, offsets
        with pytest.raises(CheckpointError, match=message.split(";")[0]):
            verify_files(out, Manifest.read(out))
