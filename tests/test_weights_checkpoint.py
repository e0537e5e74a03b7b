"""Loading experts straight from Hugging Face checkpoints of every naming scheme we read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_hidden, make_routing, make_weights
from safetensors.torch import save_file

from kt_sglang import KTMoEWrapper
from kt_sglang.engine.reference import moe_reference, relative_error
from kt_sglang.weights import Checkpoint, CheckpointError

E, K, H, I = 8, 2, 256, 128


def write_checkpoint(path: Path, config: dict, tensors: dict[str, torch.Tensor], shards: int = 1) -> Path:
    """config.json plus `shards` safetensors files (with an index when there are several)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    if shards == 1:
        save_file({n: tensors[n].contiguous() for n in names}, str(path / "model.safetensors"))
        return path
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(path / file))
        weight_map.update({n: file for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def per_expert(pattern: dict[str, str], layer: int, weights, prefix: str = "") -> dict[str, torch.Tensor]:
    gate, up, down = weights
    out = {}
    for e in range(gate.shape[0]):
        for proj, w in (("gate", gate[e]), ("up", up[e]), ("down", down[e])):
            out[prefix + pattern[proj].format(layer=layer, expert=e)] = w.bfloat16()
    return out


QWEN = {
    "gate": "model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight",
    "up": "model.layers.{layer}.mlp.experts.{expert}.up_proj.weight",
    "down": "model.layers.{layer}.mlp.experts.{expert}.down_proj.weight",
}
MIXTRAL = {
    "gate": "model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight",
    "up": "model.layers.{layer}.block_sparse_moe.experts.{expert}.w3.weight",
    "down": "model.layers.{layer}.block_sparse_moe.experts.{expert}.w2.weight",
}


def qwen_config(**kw) -> dict:
    cfg = {
        "model_type": "qwen3_moe",
        "num_experts": E,
        "num_experts_per_tok": K,
        "hidden_size": H,
        "moe_intermediate_size": I,
        "num_hidden_layers": 3,
        "mlp_only_layers": [0],
        "decoder_sparse_step": 1,
    }
    cfg.update(kw)
    return cfg


def check_layer(path: Path, layer: int, weights, method: str = "BF16", bound: float = 0.01) -> None:
    gate, up, down = weights
    n, inter, hidden = gate.shape
    w = KTMoEWrapper(layer, n, K, hidden, inter, None, 2, 1, weight_path=str(path), method=method)
    w.load_weights()
    x = make_hidden(24, hidden)
    ids, wts = make_routing(24, gate.shape[0], K)
    ref = moe_reference(x, gate.bfloat16(), up.bfloat16(), down.bfloat16(), ids, wts)
    assert relative_error(w.forward(x, ids, wts), ref) <= bound


@pytest.mark.parametrize("method,bound", [("BF16", 0.01), ("AMXINT8", 0.02), ("AMXINT4", 0.16)])
def test_qwen_per_expert(tmp_path, method, bound):
    layers = {layer: make_weights(E, I, H, seed=layer) for layer in (1, 2)}
    tensors = {n: t for layer, w in layers.items() for n, t in per_expert(QWEN, layer, w).items()}
    tensors["model.layers.0.mlp.gate_proj.weight"] = torch.randn(4 * I, H).bfloat16()  # dense layer 0
    path = write_checkpoint(tmp_path / "qwen", qwen_config(), tensors)
    assert Checkpoint(path).spec.moe_layers == (1, 2)
    check_layer(path, 2, layers[2], method, bound)


def test_mixtral_names_and_physical_map(tmp_path):
    weights = make_weights(E, I, H, seed=3)
    cfg = {
        "model_type": "mixtral",
        "num_local_experts": E,
        "num_experts_per_tok": K,
        "hidden_size": H,
        "intermediate_size": I,
        "num_hidden_layers": 1,
    }
    path = write_checkpoint(tmp_path / "mixtral", cfg, per_expert(MIXTRAL, 0, weights))
    check_layer(path, 0, weights)
    slots = [7, 0, 3, 3]
    w = KTMoEWrapper(0, 4, K, H, I, None, 2, 1, weight_path=str(path), method="BF16")
    w.load_weights(slots)
    x = make_hidden(10, H)
    ids, wts = make_routing(10, 4, K)
    ref = moe_reference(x, *(t[slots].bfloat16() for t in weights), ids, wts)
    assert relative_error(w.forward(x, ids, wts), ref) <= 0.01


def test_deepseek_fp8_dense_first_layers_and_mtp(tmp_path):
    """FP8 e4m3 experts with 128x128-style block scales (64 here), dense layer 0, an MTP layer 2."""
    weights = make_weights(E, I, H, seed=4)
    block = 64
    tensors = {}
    fp8_weights = []
    for proj, stack in zip(("gate", "up", "down"), weights, strict=True):
        deq = []
        for e in range(E):
            w = stack[e]
            blocks = w.reshape(w.shape[0] // block, block, w.shape[1] // block, block)
            scale = blocks.abs().amax(dim=(1, 3)) / 448.0
            q = (w / scale.repeat_interleave(block, 0).repeat_interleave(block, 1)).to(torch.float8_e4m3fn)
            name = QWEN[proj].format(layer=1, expert=e)
            tensors[name], tensors[name + "_scale_inv"] = q, scale
            deq.append(q.float() * scale.repeat_interleave(block, 0).repeat_interleave(block, 1))
        fp8_weights.append(torch.stack(deq))
    tensors.update(per_expert(QWEN, 2, make_weights(E, I, H, seed=5)))  # MTP layer past num_hidden_layers
    cfg = {
        "model_type": "deepseek_v3",
        "n_routed_experts": E,
        "num_experts_per_tok": K,
        "hidden_size": H,
        "moe_intermediate_size": I,
        "num_hidden_layers": 2,
        "first_k_dense_replace": 1,
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [block, block]},
    }
    path = write_checkpoint(tmp_path / "deepseek", cfg, tensors)
    assert Checkpoint(path).spec.moe_layers == (1,)
    check_layer(path, 1, fp8_weights, "AMXINT8", 0.02)
    with pytest.raises(CheckpointError, match="layer 2 is not an MoE layer"):
        KTMoEWrapper(2, E, K, H, I, None, 2, 1, weight_path=str(path), method="BF16").load_weights()
    del tensors[QWEN["up"].format(layer=1, expert=3) + "_scale_inv"]
    broken = write_checkpoint(tmp_path / "deepseek-no-scales", cfg, tensors)
    with pytest.raises(CheckpointError, match=r"experts.3.up_proj.weight is FP8 but .*_scale_inv is missing"):
        KTMoEWrapper(1, E, K, H, I, None, 2, 1, weight_path=str(broken), method="BF16").load_weights()


def test_sharded_with_language_model_prefix(tmp_path):
    weights = make_weights(E, I, H, seed=7)
    tensors = per_expert(QWEN, 1, weights, prefix="language_model.")
    cfg = {"model_type": "some_vlm", "text_config": qwen_config(num_hidden_layers=2)}
    path = write_checkpoint(tmp_path / "vlm", cfg, tensors, shards=3)
    check_layer(path, 1, weights)


def test_checkpoint_errors(tmp_path):
    with pytest.raises(CheckpointError, match="config.json does not exist"):
        Checkpoint(tmp_path)
    weights = make_weights(E, I, H, seed=8)
    good = per_expert(QWEN, 1, weights)
    path = write_checkpoint(tmp_path / "sharded", qwen_config(num_hidden_layers=2), good, shards=2)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        CheckpointError, match="names shard model-00002-of-00002.safetensors, which is missing"
    ):
        Checkpoint(path)
    path = write_checkpoint(tmp_path / "truncated", qwen_config(num_hidden_layers=2), good)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or not safetensors"):
        Checkpoint(path)
    bad = dict(good)
    bad[QWEN["down"].format(layer=1, expert=5)] = torch.zeros(H, I + 1).bfloat16()
    path = write_checkpoint(tmp_path / "shape", qwen_config(num_hidden_layers=2), bad)
    with pytest.raises(
        CheckpointError, match=r"experts.5.down_proj.weight in model.safetensors has shape \[256, 129\]"
    ):
        KTMoEWrapper(1, E, K, H, I, None, 2, 1, weight_path=str(path), method="BF16").load_weights()
    path = write_checkpoint(tmp_path / "other", qwen_config(num_hidden_layers=2, hidden_size=512), good)
    with pytest.raises(CheckpointError, match="hidden_size is 512; this layer was built with 256"):
        KTMoEWrapper(1, E, K, H, I, None, 2, 1, weight_path=str(path), method="BF16").load_weights()
    path = write_checkpoint(tmp_path / "llama", {"model_type": "llama"}, good)
    with pytest.raises(ValueError, match="model_type 'llama' is not a supported MoE family"):
        Checkpoint(path)
    with pytest.raises(ValueError, match="load_weights needs weight_path"):
        KTMoEWrapper(1, E, K, H, I, None, 2, 1, method="BF16").load_weights()


def _without_root_override(code: str, cwd: Path) -> subprocess.CompletedProcess:
    """Runs ``code`` where file modes apply: as another user, or as root without the capabilities
    that bypass them (CI runs as root)."""
    if os.geteuid() != 0:
        cmd = [sys.executable, "-c", code]
    else:  # setpriv: util-linux, on every Debian system
        cmd = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-all"]
        cmd += [sys.executable, "-c", code]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=cwd)


def test_unreadable_files_say_why(tmp_path):
    """A shard without read permission is named with that reason (safetensors alone says "No such
    file or directory"); a directory in a shard's place, as one."""
    good = {QWEN["gate"].format(layer=1, expert=e): torch.zeros(I, H).bfloat16() for e in range(E)}
    path = write_checkpoint(tmp_path / "locked", qwen_config(num_hidden_layers=2), good)
    shard = path / "model.safetensors"
    shard.chmod(0)
    code = (
        "from kt_sglang.weights.checkpoint import open_checkpoint\n"
        f"try:\n    open_checkpoint({str(path)!r})\nexcept ValueError as exc:\n    print(exc)"
    )
    r = _without_root_override(code, tmp_path)
    assert f"cannot read {shard}: permission denied (mode ----------" in r.stdout, r.stdout + r.stderr[-2000:]
    shard.chmod(0o644)
    (path / "config.json").chmod(0)
    r = _without_root_override(code, tmp_path)
    assert f"cannot read {path / 'config.json'}: permission denied" in r.stdout, r.stdout + r.stderr[-2000:]
    (path / "config.json").chmod(0o644)
    shard.unlink()
    shard.mkdir()
    with pytest.raises(CheckpointError, match=f"cannot read {shard}: it is a directory"):
        Checkpoint(path)


@pytest.mark.parametrize("method", ["BF16", "AMXINT4"])
def test_the_gpus_experts_are_neither_read_nor_held(tmp_path, method):
    """gpu_experts_mask: the masked experts take no packed bytes, are not read from the checkpoint
    (their tensors may be missing) nor from a converted directory, and are not computed; the rest
    equal the float32 MoE. kt-kernel holds a CPU copy of every expert."""
    from kt_sglang.weights.convert_cpu import main as convert_cpu

    weights = make_weights(E, I, H, seed=8)
    on_gpu = torch.zeros(E, dtype=torch.bool)
    on_gpu[[1, 2, 5, 6]] = True
    tensors = per_expert(QWEN, 1, weights)
    full = write_checkpoint(tmp_path / "full", qwen_config(num_hidden_layers=2), dict(tensors))
    for e in (1, 5):  # the GPU's copy is all a server with these experts hot needs
        for proj in ("gate", "up", "down"):
            del tensors[QWEN[proj].format(layer=1, expert=e)]
    partial = write_checkpoint(tmp_path / "partial", qwen_config(num_hidden_layers=2), tensors)
    converted = tmp_path / "converted"
    args = ["--input-path", str(full), "--output", str(converted), "--quant-method", method]
    assert convert_cpu(args) == 0
    x = make_hidden(16, H)
    ids, wts = make_routing(16, E, K, seed=9)
    cold_ids = torch.where(on_gpu[ids], -1, ids)
    ref = moe_reference(x, *(t.bfloat16() for t in weights), cold_ids, wts)
    whole = KTMoEWrapper(1, E, K, H, I, None, 2, 1, weight_path=str(full), method=method)
    whole.load_weights()
    bound = 0.01 if method == "BF16" else 0.16
    for path in (partial, converted):
        w = KTMoEWrapper(1, E, K, H, I, on_gpu, 2, 1, weight_path=str(path), method=method)
        w.load_weights()
        assert w.packed_bytes * E == whole.packed_bytes * (E - int(on_gpu.sum()))
        assert relative_error(w.forward(x, ids, wts), ref) <= bound
    gate, up, down = (t.bfloat16() for t in weights)
    dense = KTMoEWrapper(1, E, K, H, I, on_gpu, 2, 1, method=method)
    gate[on_gpu] = float("nan")  # not read: NaN weights of a held expert are refused at load
    dense.load_weights_from_tensors(gate, up, down)
    assert relative_error(dense.forward(x, ids, wts), ref) <= bound
    with pytest.raises(CheckpointError):
        KTMoEWrapper(1, E, K, H, I, None, 2, 1, weight_path=str(partial), method=method).load_weights()


@pytest.mark.parametrize("layout", ["safetensors", "raw"])
def test_a_kt_kernel_conversion_it_cannot_read_is_named(tmp_path, layout):
    """kt-kernel's converted directories are served (tests/test_kt_kernel_dirs.py); one whose tensors
    are not a kt-kernel INT8 / INT4 layer of the model, or of a kt-kernel type we do not read, is
    refused naming the file."""
    if layout == "safetensors":
        tensors = {
            f"blk.1.ffn_{p}_exps.{e}.numa.0.{t}": torch.zeros(64, dtype=torch.int8)
            for p in ("gate", "up", "down")
            for e in range(E)
            for t in ("weight", "scale")
        }
        path = write_checkpoint(tmp_path / "converted", qwen_config(), tensors)
        message = r"blk\.1\.ffn_gate_exps\.0\.numa\.0\.weight in .* holds 64 bytes: neither INT8 nor INT4"
    else:
        path = tmp_path / "converted"
        (path / "_layer_1" / "_numa_0").mkdir(parents=True)
        (path / "_layer_1" / "_numa_0" / "INT4_1K_up_0_64Byte_quant_.kt").write_bytes(bytes(64))
        (path / "config.json").write_text(json.dumps(qwen_config()))
        message = (
            r"INT4_1K_up_0_64Byte_quant_\.kt: kt-kernel's INT4_1K experts are not a layout kt-sglang reads"
        )
    with pytest.raises(CheckpointError, match=message):
        KTMoEWrapper(1, E, K, H, I, None, 1, 1, weight_path=str(path), method="MOE_INT8").load_weights()
