"""GGUF models (`--kt-method LLAMAFILE`): each block type against llama.cpp's own numpy decoders
(``gguf.quants``), a layer written with the ``gguf`` package against a float32 MoE of the file's
dequantized weights, and the errors a file that cannot be served gives."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import isa_params, make_hidden, make_routing
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf_files import gguf_rows, llama_cpp_values, write_gguf

from kt_sglang.engine import KTMoEWrapper
from kt_sglang.engine.activation import Glu
from kt_sglang.engine.canonical import dequantize
from kt_sglang.engine.reference import moe_reference, relative_error
from kt_sglang.weights.gguf import GgufModel
from kt_sglang.weights.gguf_blocks import BLOCK_TYPES
from kt_sglang.weights.source import CheckpointError

E, TOP_K, H, I = 8, 2, 256, 256  # K of both projections a multiple of the K-quants' 256


@pytest.mark.parametrize("qtype", list(BLOCK_TYPES), ids=lambda q: q.name)
def test_block_type_gives_llama_cpp_values(qtype):
    N, K = 6, 512
    w = np.random.default_rng(1).standard_normal((N, K)).astype(np.float32) / K**0.5
    rows = gguf_rows(qtype, w)
    expected = llama_cpp_values(qtype, rows)
    bt = BLOCK_TYPES[qtype]
    got = dequantize(bt.method, bt.transcode(rows, K), K, bt.group).numpy()
    assert np.abs(got - expected).max() <= bt.error * np.abs(expected).max()
    if bt.error == 0.0:
        np.testing.assert_array_equal(got, expected)


def write_model(
    path: Path,
    types: dict[str, Q],
    layers: tuple[int, ...] = (1,),
    fused: bool = False,
    split_max_tensors: int = 0,
    experts: int = E,
    metadata: dict[str, int | list[int]] | None = None,
    arch: str = "qwen3moe",
    biases: bool = False,
) -> dict[int, dict[str, np.ndarray]]:
    """A MoE GGUF model of ``arch`` at ``path`` (``types``: gate, up, down; gpt-oss's expert biases
    with ``biases``); returns each layer's float32 values as llama.cpp decodes them (and the biases,
    as ``gate_bias``...)."""
    meta = {"expert_count": experts, "expert_used_count": TOP_K, "embedding_length": H}
    meta |= {"expert_feed_forward_length": I, "block_count": max(layers) + 1} | (metadata or {})
    tensors, values = {}, {}
    gen = np.random.default_rng(7)
    for layer in layers:
        values[layer], rows = {}, {}
        for i, (proj, shape) in enumerate({"gate": (I, H), "up": (I, H), "down": (H, I)}.items()):
            w = gen.standard_normal((experts, *shape)).astype(np.float32) / shape[1] ** 0.5
            rows[proj] = gguf_rows(types[proj], w, seed=layer * 3 + i)
            values[layer][proj] = llama_cpp_values(types[proj], rows[proj])
        tensors[f"blk.{layer}.attn_norm.weight"] = (np.ones(H, np.float32).view(np.uint8), Q.F32)
        if fused:
            assert types["gate"] == types["up"]
            gate_up = np.concatenate([rows["gate"], rows["up"]], axis=1)
            tensors[f"blk.{layer}.ffn_gate_up_exps.weight"] = (gate_up, types["gate"])
        else:
            for proj in ("gate", "up"):
                tensors[f"blk.{layer}.ffn_{proj}_exps.weight"] = (rows[proj], types[proj])
        tensors[f"blk.{layer}.ffn_down_exps.weight"] = (rows["down"], types["down"])
        for proj, n in (("gate", I), ("up", I), ("down", H)) if biases else ():
            b = gen.standard_normal((experts, n)).astype(np.float32) * 0.1
            tensors[f"blk.{layer}.ffn_{proj}_exps.bias"] = (b.view(np.uint8), Q.F32)
            values[layer][f"{proj}_bias"] = b
    write_gguf(path, arch, tensors, meta, split_max_tensors)
    return values


def llamafile_layer(path, isa: str | None = None, layer: int = 1, **kw) -> KTMoEWrapper:
    args = dict(
        layer_idx=layer,
        num_experts=E,
        num_experts_per_tok=TOP_K,
        hidden_size=H,
        moe_intermediate_size=I,
        gpu_experts_mask=None,
        cpuinfer_threads=2,
        threadpool_count=1,
        weight_path=str(path),
        method="LLAMAFILE",
        isa=isa,
    )
    return KTMoEWrapper(**(args | kw))


# One type per engine method, the types users run most (Q4_K, Q8_0), and a layer whose gate/up and
# down are computed by different methods (the K-quant mixes: Q4_K gate/up, a wider type for down).
LAYER_TYPES = [(q, q, q) for q in (Q.Q8_0, Q.Q4_K, Q.Q4_0, Q.IQ4_XS, Q.MXFP4, Q.BF16, Q.Q2_K, Q.Q5_K)]
LAYER_TYPES += [(Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.Q3_K, Q.Q3_K, Q.Q5_K), (Q.Q8_0, Q.Q8_0, Q.Q4_K)]
LAYER_TYPES += [(Q.BF16, Q.BF16, Q.MXFP4)]


@pytest.mark.parametrize("isa", isa_params(("scalar", "avx2", "avx512", "amx")))
@pytest.mark.parametrize("types", LAYER_TYPES, ids=lambda t: "-".join(q.name for q in t))
def test_layer_against_float32_moe(tmp_path, types, isa):
    path = tmp_path / "model.gguf"
    values = write_model(path, dict(zip(("gate", "up", "down"), types, strict=True)))[1]
    layer = llamafile_layer(path, isa)
    assert layer.config.file_method == "LLAMAFILE"
    assert (layer.method.value, layer.down_method.value) == (
        BLOCK_TYPES[types[0]].method,
        BLOCK_TYPES[types[2]].method,
    )
    layer.load_weights()
    x = make_hidden(9, H)
    ids, weights = make_routing(9, E, TOP_K)
    out = layer.forward(x, ids, weights)
    gate, up, down = (torch.from_numpy(values[p]) for p in ("gate", "up", "down"))
    # int8 activations (as llama.cpp's own CPU kernels quantize them) where a method has them
    int8 = layer.method.info.int8_activations or layer.down_method.info.int8_h
    bound = 0.02 if int8 else 0.01
    assert relative_error(out, moe_reference(x, gate, up, down, ids, weights)) <= bound


def test_gpt_oss_swiglu_and_biases(tmp_path):
    """gpt-oss: MXFP4 experts with biases, computed with the activation llama.cpp gives the
    architecture (SwiGLU, alpha 1.702, clamped at 7)."""
    path = tmp_path / "gpt-oss.gguf"
    values = write_model(path, dict.fromkeys(("gate", "up", "down"), Q.MXFP4), arch="gpt-oss", biases=True)[1]
    layer = llamafile_layer(path)
    assert layer.activation == Glu("swiglu_oai", 7.0, 1.702)
    layer.load_weights()
    x = make_hidden(9, H)
    ids, weights = make_routing(9, E, TOP_K)
    t = {name: torch.from_numpy(v) for name, v in values.items()}
    biases = (t["gate_bias"], t["up_bias"], t["down_bias"])
    ref = moe_reference(
        x, t["gate"], t["up"], t["down"], ids, weights, activation=layer.activation, biases=biases
    )
    assert relative_error(layer.forward(x, ids, weights), ref) <= 0.01
    with pytest.raises(CheckpointError, match="gpt-oss experts use the activation"):
        llamafile_layer(path, activation=Glu("silu")).load_weights()


def test_known_weights_round_trip(tmp_path):
    """Weights quantized by the gguf package and written with its writer come back as the values
    llama.cpp decodes, near the weights themselves."""
    path = tmp_path / "model.gguf"
    values = write_model(path, {"gate": Q.Q8_0, "up": Q.Q8_0, "down": Q.Q4_0})
    model = GgufModel(path)
    gate, up, down = model.read_experts(1, [3, 5])
    for got, proj, method in ((gate, "gate", "AMXINT8"), (up, "up", "AMXINT8"), (down, "down", "AMXINT4")):
        K = values[1][proj].shape[-1]
        for m, e in zip(got, (3, 5), strict=True):
            np.testing.assert_array_equal(dequantize(method, m, K, 32).numpy(), values[1][proj][e])
    assert model.layer_methods(1, E, H, I) == (("AMXINT8", 32), ("AMXINT4", 32))
    mixed = tmp_path / "mixed.gguf"
    write_model(mixed, {"gate": Q.Q8_0, "up": Q.Q4_0, "down": Q.Q4_0})
    with pytest.raises(CheckpointError, match=r"stores gate in Q8_0 \(AMXINT8\) and up in Q4_0 \(AMXINT4\)"):
        GgufModel(mixed).layer_methods(1, E, H, I)


def test_split_and_fused_models(tmp_path):
    """A split set read from its first file or its directory, with fused gate_up tensors."""
    folder = tmp_path / "split"
    folder.mkdir()
    values = write_model(
        folder / "m.gguf",
        dict.fromkeys(("gate", "up", "down"), Q.Q8_0),
        layers=(0, 1),
        fused=True,
        split_max_tensors=2,
    )
    files = sorted(p.name for p in folder.iterdir())
    assert len(files) > 1 and files[0] == f"m-00001-of-{len(files):05d}.gguf"
    for path in (folder, folder / files[0]):
        model = GgufModel(path)
        assert model.expert_layers() == [0, 1]
        gate, up, down = model.read_experts(1, [2])
        np.testing.assert_array_equal(dequantize("AMXINT8", up[0], H, 32).numpy(), values[1]["up"][2])
    (folder / files[-1]).unlink()
    with pytest.raises(CheckpointError, match=f"missing beside it: {files[-1]}"):
        GgufModel(folder)


def test_physical_map_and_gpu_experts(tmp_path, monkeypatch):
    """Slots from a physical-to-logical map, the GPU's experts not read, three experts a step."""
    from kt_sglang.weights.sources import gguf as gguf_source

    monkeypatch.setattr(gguf_source, "GGUF_STEP_BYTES", 3 * 3 * H * I)
    path = tmp_path / "model.gguf"
    values = write_model(path, dict.fromkeys(("gate", "up", "down"), Q.Q8_0))[1]
    mask = torch.zeros(E, dtype=torch.bool)
    mask[[0, 4]] = True
    layer = llamafile_layer(path, gpu_experts_mask=mask)
    order = [7, 6, 5, 4, 3, 2, 1, 0]
    layer.load_weights(torch.tensor(order))
    x = make_hidden(5, H)
    ids, weights = make_routing(5, E, TOP_K)
    out = layer.forward(x, ids, weights)
    gate, up, down = (torch.from_numpy(values[p][order]) for p in ("gate", "up", "down"))
    assert relative_error(out, moe_reference(x, gate, up, down, ids, weights, mask)) <= 0.02


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"types": dict.fromkeys(("gate", "up", "down"), Q.IQ2_XS)},
            r"blk\.1\.ffn_gate_exps\.weight in model\.gguf is GGUF type IQ2_XS, which the CPU engine "
            "does not compute",
        ),
        (
            {"experts": E + 1, "metadata": {"expert_count": E}},
            r"holds 9 experts of \[256, 256\].*the model's config gives 8 experts",
        ),
        (
            {"metadata": {"embedding_length": 512}},
            r"qwen3moe\.embedding_length is 512; the model's config gives 256",
        ),
        (  # per layer, as llama.cpp also reads it: layer 1's
            {"metadata": {"expert_feed_forward_length": [I, 2 * I]}},
            r"qwen3moe\.expert_feed_forward_length is 512; the model's config gives 256",
        ),
    ],
    ids=["unsupported-type", "shape", "metadata", "metadata-per-layer"],
)
def test_model_that_does_not_fit_is_refused(tmp_path, change, message):
    path = tmp_path / "model.gguf"
    types = change.pop("types", dict.fromkeys(("gate", "up", "down"), Q.Q8_0))
    if types["gate"] == Q.IQ2_XS:  # zero blocks: no quantizer for it here
        block, size = GGML_QUANT_SIZES[Q.IQ2_XS]
        shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
        tensors = {
            f"blk.1.ffn_{p}_exps.weight": (np.zeros((E, N, K // block * size), np.uint8), Q.IQ2_XS)
            for p, (N, K) in shapes.items()
        }
        write_gguf(path, "qwen3moe", tensors, {})
    else:
        write_model(path, types, **change)
    with pytest.raises(CheckpointError, match=message):
        llamafile_layer(path)


def test_unreadable_files_say_why(tmp_path):
    path = tmp_path / "model.gguf"
    write_model(path, dict.fromkeys(("gate", "up", "down"), Q.Q8_0))
    with pytest.raises(CheckpointError, match="missing"):
        GgufModel(tmp_path / "other.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size - 1000])
    with pytest.raises(CheckpointError, match=r"cannot read .*cut\.gguf: truncated or damaged GGUF"):
        GgufModel(cut)
    header = tmp_path / "header.gguf"
    header.write_bytes(path.read_bytes()[:40])
    with pytest.raises(CheckpointError, match=r"header\.gguf: truncated or damaged GGUF"):
        GgufModel(header)
    other = tmp_path / "not.gguf"
    other.write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        GgufModel(other)
    folder = tmp_path / "two"
    folder.mkdir()
    shutil.copy(path, folder / "a.gguf")
    shutil.copy(path, folder / "b.gguf")
    with pytest.raises(CheckpointError, match="holds 2 GGUF models"):
        GgufModel(folder)


def test_gguf_needs_llamafile(tmp_path):
    path = tmp_path / "model.gguf"
    write_model(path, dict.fromkeys(("gate", "up", "down"), Q.Q8_0))
    layer = llamafile_layer(path, method="AMXINT8")
    with pytest.raises(CheckpointError, match="is a GGUF model: load it with method LLAMAFILE"):
        layer.load_weights()
    with pytest.raises(
        ValueError, match="LLAMAFILE computes each GGUF tensor in its own type: give weight_path"
    ):
        llamafile_layer(path, weight_path=None)
    with pytest.raises(ValueError, match="group_size=64: layer 1 of .* is stored in blocks of 32"):
        llamafile_layer(path, group_size=64)


def test_fine_tuning_refuses_a_layer_of_two_methods(tmp_path):
    path = tmp_path / "model.gguf"
    write_model(path, {"gate": Q.Q4_K, "up": Q.Q4_K, "down": Q.Q8_0})
    with pytest.raises(
        ValueError, match="fine-tuning reads gate/up and down with one method; this layer has two"
    ):
        llamafile_layer(path, mode="sft")
