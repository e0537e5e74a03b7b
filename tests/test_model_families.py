"""Model families of configs/models: tiny models built with transformers' own classes, saved as
transformers saves them or as the hub ships them, read back through Checkpoint and run on the engine."""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from conftest import make_hidden, make_routing, make_weights
from safetensors import safe_open
from safetensors.torch import save_file

from kt_sglang import KTMoEWrapper
from kt_sglang.engine.reference import moe_reference, relative_error
from kt_sglang.weights import Checkpoint, CheckpointError, families

E, K = 8, 2
TEXT = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64, intermediate_size=64)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2)


def tiny_model(model_type: str, hidden: int, inter: int, layers: int, **text) -> torch.nn.Module:
    """A randomly initialized bf16 model of the family, from transformers' own config and model classes."""
    torch.manual_seed(0)
    text = dict(TEXT, hidden_size=hidden, moe_intermediate_size=inter, num_hidden_layers=layers, **text)
    if model_type == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(
            transformers.Qwen3MoeConfig(num_experts=E, num_experts_per_tok=K, **text)
        )
    elif model_type == "qwen3_vl_moe":
        config = transformers.Qwen3VLMoeConfig(
            text_config=dict(num_experts=E, num_experts_per_tok=K, **text),
            vision_config=dict(VISION, out_hidden_size=hidden, deepstack_visual_indexes=[0]),
        )
        model = transformers.Qwen3VLMoeForConditionalGeneration(config)
    elif model_type == "qwen3_5_moe":
        linear_attention = dict(
            linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16
        )
        config = transformers.Qwen3_5MoeConfig(
            text_config=dict(
                num_experts=E,
                num_experts_per_tok=K,
                shared_expert_intermediate_size=32,
                **linear_attention,
                **text,
            ),
            vision_config=dict(VISION, out_hidden_size=hidden),
        )
        model = transformers.Qwen3_5MoeForConditionalGeneration(config)
    else:
        text.pop("head_dim")
        config = transformers.Glm4vMoeConfig(
            text_config=dict(n_routed_experts=E, num_experts_per_tok=K, n_shared_experts=1, **text),
            vision_config=dict(VISION, out_hidden_size=hidden),
        )
        model = transformers.Glm4vMoeForConditionalGeneration(config)
    return model.to(torch.bfloat16).eval()


def decoder_layers(model: torch.nn.Module):
    return getattr(model.model, "language_model", model.model).layers


def stored(path: Path) -> dict[str, tuple[list[int], str]]:
    """name -> (shape, dtype) of every tensor in the directory's safetensors files."""
    out = {}
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                out[name] = (piece.get_shape(), piece.get_dtype())
    return out


def rewrite(saved: Path, path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """The saved model's config.json with other tensors: the layouts save_pretrained does not write."""
    path.mkdir()
    shutil.copy(saved / "config.json", path / "config.json")
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(path / "model.safetensors"))
    return path


def check_family(path: Path, model: torch.nn.Module) -> None:
    """The checkpoint's MoE layers, experts and engine output against the transformers model itself."""
    layers = decoder_layers(model)
    moe_layers = tuple(i for i, block in enumerate(layers) if hasattr(block.mlp, "experts"))
    ckpt = Checkpoint(path)
    assert ckpt.spec.moe_layers == moe_layers
    layer = moe_layers[-1]
    experts = layers[layer].mlp.experts
    H, I = ckpt.spec.hidden_size, ckpt.spec.intermediate_size
    assert experts.gate_up_proj.shape == (E, 2 * I, H)  # transformers 5 in memory: [E, 2I, H], [E, H, I]
    gate, up, down = ckpt.layer_experts(layer)
    assert ckpt.expert_dtype(layer) == torch.bfloat16
    assert torch.equal(gate, experts.gate_up_proj[:, :I])
    assert torch.equal(up, experts.gate_up_proj[:, I:])
    assert torch.equal(down, experts.down_proj)

    w = KTMoEWrapper(layer, E, K, H, I, None, 2, 1, weight_path=str(path), method="BF16")
    w.load_weights()
    x = make_hidden(16, H)
    ids, wts = make_routing(16, E, K)
    out = w.forward(x, ids, wts)
    with torch.no_grad():  # transformers' own experts forward, in float32
        own = copy.deepcopy(experts).float()(x.float(), ids, wts.float())
    assert relative_error(out, own) <= 0.01
    assert relative_error(out, moe_reference(x, gate, up, down, ids, wts)) <= 0.01


def test_qwen3_moe(tmp_path):
    """save_pretrained writes per-expert names; a raw state_dict holds the fused [E, 2I, H] tensors."""
    model = tiny_model("qwen3_moe", 128, 96, 3, mlp_only_layers=[0])
    model.save_pretrained(tmp_path / "saved")
    names = stored(tmp_path / "saved")
    assert names["model.layers.1.mlp.experts.7.gate_proj.weight"] == ([96, 128], "BF16")
    assert names["model.layers.1.mlp.experts.7.down_proj.weight"] == ([128, 96], "BF16")
    check_family(tmp_path / "saved", model)
    fused = rewrite(tmp_path / "saved", tmp_path / "fused", model.state_dict())
    assert stored(fused)["model.layers.1.mlp.experts.gate_up_proj"] == ([E, 192, 128], "BF16")
    check_family(fused, model)


def test_qwen3_vl_moe(tmp_path):
    """The hub ships fused [E, H, 2I] / [E, I, H] (transformers transposes them on load); transformers 5's
    save_pretrained writes its in-memory [E, 2I, H] / [E, H, I] under the same names, which is refused."""
    model = tiny_model("qwen3_vl_moe", 128, 96, 4, decoder_sparse_step=2, mlp_only_layers=[1])  # MoE: 3
    model.save_pretrained(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert (
        config["model_type"] == "qwen3_vl_moe" and config["text_config"]["model_type"] == "qwen3_vl_moe_text"
    )
    gate_up = "model.language_model.layers.3.mlp.experts.gate_up_proj"
    assert stored(tmp_path / "saved")[gate_up] == ([E, 192, 128], "BF16")
    with pytest.raises(
        CheckpointError,
        match=rf"{gate_up} in model.safetensors has shape \[8, 192, 128\] \(the other orientation\); "
        rf"expected \[8, 128, 192\] \(\[E, H, 2I\]: the layout configs/models/qwen3_vl_moe.json declares",
    ):
        Checkpoint(tmp_path / "saved").layer_experts(3)

    state = {
        n: t.transpose(1, 2) if n.endswith(("experts.gate_up_proj", "experts.down_proj")) else t
        for n, t in model.state_dict().items()
    }
    hub = rewrite(tmp_path / "saved", tmp_path / "hub", state)
    assert stored(hub)[gate_up] == ([E, 128, 192], "BF16")
    loaded = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(hub, dtype=torch.bfloat16)
    assert torch.equal(
        decoder_layers(loaded)[3].mlp.experts.gate_up_proj, decoder_layers(model)[3].mlp.experts.gate_up_proj
    )
    check_family(hub, model)


def test_qwen3_5_moe(tmp_path):
    """save_pretrained writes per-expert names; the hub ships fused [E, 2I, H] / [E, H, I], which
    transformers reads as they are."""
    model = tiny_model("qwen3_5_moe", 128, 96, 2)
    model.save_pretrained(tmp_path / "saved")
    names = stored(tmp_path / "saved")
    assert names["model.language_model.layers.1.mlp.experts.7.up_proj.weight"] == ([96, 128], "BF16")
    assert not any(n.endswith("gate_up_proj") for n in names)
    check_family(tmp_path / "saved", model)

    hub = rewrite(tmp_path / "saved", tmp_path / "hub", model.state_dict())
    gate_up = "model.language_model.layers.1.mlp.experts.gate_up_proj"
    assert stored(hub)[gate_up] == ([E, 192, 128], "BF16")
    loaded = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(hub, dtype=torch.bfloat16)
    assert torch.equal(
        decoder_layers(loaded)[1].mlp.experts.down_proj, decoder_layers(model)[1].mlp.experts.down_proj
    )
    check_family(hub, model)


def test_glm4v_moe(tmp_path):
    """Per-expert names under model.language_model; the first_k_dense_replace layers are dense."""
    model = tiny_model("glm4v_moe", 128, 96, 3, first_k_dense_replace=1)
    model.save_pretrained(tmp_path / "saved")
    names = stored(tmp_path / "saved")
    assert names["model.language_model.layers.2.mlp.experts.7.gate_proj.weight"] == ([96, 128], "BF16")
    assert "model.language_model.layers.0.mlp.gate_proj.weight" in names  # the dense layer
    check_family(tmp_path / "saved", model)


FUSED = {
    "qwen3_moe": ("model.layers.{layer}.mlp.experts.", False),
    "qwen3_vl_moe": ("model.language_model.layers.{layer}.mlp.experts.", True),
}


def fused_checkpoint(path: Path, model_type: str, weights, hidden: int, transposed: bool) -> Path:
    gate, up, down = weights
    inter = gate.shape[1]
    gate_up = torch.cat([gate, up], 1)  # [E, 2I, H], [E, H, I]
    if transposed:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    prefix = FUSED[model_type][0].format(layer=1)
    text = {
        "model_type": model_type if model_type == "qwen3_moe" else "qwen3_vl_moe_text",
        "num_experts": E,
        "num_experts_per_tok": K,
        "hidden_size": hidden,
        "moe_intermediate_size": inter,
        "num_hidden_layers": 2,
        "mlp_only_layers": [0],
    }
    config = text if model_type == "qwen3_moe" else {"model_type": model_type, "text_config": text}
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    tensors = {prefix + "gate_up_proj": gate_up.bfloat16(), prefix + "down_proj": down.bfloat16()}
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("model_type", FUSED)
def test_fused_orientation_when_hidden_is_twice_intermediate(tmp_path, model_type):
    """H == 2I: both orientations have the same shape; the family's declared layout reads it right."""
    I, H = 64, 128
    weights = make_weights(E, I, H, seed=6)
    path = fused_checkpoint(tmp_path / model_type, model_type, weights, H, FUSED[model_type][1])
    gate, up, down = Checkpoint(path).layer_experts(1)
    for got, want in zip((gate, up, down), weights, strict=True):
        assert torch.equal(got, want.bfloat16())
    w = KTMoEWrapper(1, E, K, H, I, None, 2, 1, weight_path=str(path), method="BF16")
    w.load_weights()
    x = make_hidden(16, H)
    ids, wts = make_routing(16, E, K)
    ref = moe_reference(x, *(t.bfloat16() for t in weights), ids, wts)
    assert relative_error(w.forward(x, ids, wts), ref) <= 0.01


@pytest.mark.parametrize("model_type", FUSED)
def test_fused_orientation_other_than_declared(tmp_path, model_type):
    weights = make_weights(E, 128, 384, seed=7)
    path = fused_checkpoint(tmp_path / model_type, model_type, weights, 384, not FUSED[model_type][1])
    name = FUSED[model_type][0].format(layer=1) + "gate_up_proj"
    linear, transposed = [8, 256, 384], [8, 384, 256]  # [E, 2I, H], [E, H, 2I]
    found, expected = (linear, transposed) if FUSED[model_type][1] else (transposed, linear)
    message = f"{name} in model.safetensors has shape {found} (the other orientation); expected {expected}"
    with pytest.raises(CheckpointError, match=re.escape(message)):
        Checkpoint(path).layer_experts(1)


def test_family_files_declare_the_fused_layout(tmp_path, monkeypatch):
    for family in families.load_families():
        assert set(family.fused_layout) == set(family.fused_experts)
    data = json.loads((families._configs_dir() / "qwen_moe.json").read_text())
    del data["fused_layout"]
    (tmp_path / "qwen_moe.json").write_text(json.dumps(data))
    monkeypatch.setattr(families, "_configs_dir", lambda: tmp_path)
    families.load_families.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"qwen_moe.json: fused_layout must name the layout"):
            families.load_families()
    finally:
        families.load_families.cache_clear()


@pytest.mark.parametrize("model_type", FUSED)
def test_a_layer_loads_a_few_experts_at_a_time(tmp_path, model_type, monkeypatch):
    """Quantized at load in steps of two experts (rows of the fused tensors read per step), with the
    GPU's experts skipped: the same packed layer as one step of all of them."""
    from kt_sglang.weights.sources import hf_checkpoint

    I, H = 64, 128
    weights = make_weights(E, I, H, seed=12)
    path = fused_checkpoint(tmp_path / model_type, model_type, weights, H, FUSED[model_type][1])
    mask = torch.zeros(E, dtype=torch.bool)
    mask[[0, 3, 4]] = True  # held: 1, 2, 5, 6, 7 (two runs of rows)
    x = make_hidden(16, H)
    ids, wts = make_routing(16, E, K, seed=13)
    outputs = []
    for chunk in (2**40, 2 * 3 * H * I * 4):  # one step; two experts a step
        monkeypatch.setattr(hf_checkpoint, "DENSE_STEP_BYTES", chunk)
        w = KTMoEWrapper(1, E, K, H, I, mask, 2, 1, weight_path=str(path), method="AMXINT8")
        w.load_weights()
        outputs.append(w.forward(x, ids, wts))
    assert torch.equal(outputs[0], outputs[1])
    ref = moe_reference(x, *(t.bfloat16() for t in weights), torch.where(mask[ids], -1, ids), wts)
    assert relative_error(outputs[1], ref) <= 0.02
