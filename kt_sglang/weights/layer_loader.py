"""Loading one layer's experts from disk into a `KTMoEWrapper`: a directory `kt-sglang convert-cpu`
wrote, or a Hugging Face checkpoint (taken as it is by the method that reads its format, else
quantized on load a few experts at a time). Only the experts of the layer's held slots are read.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kt_sglang.engine.activation import SILU, Glu
from kt_sglang.engine.methods import METHODS
from kt_sglang.weights import formats, packed_files
from kt_sglang.weights.canonical_files import MANIFEST, Manifest, is_canonical_dir, read_layer
from kt_sglang.weights.checkpoint import open_checkpoint
from kt_sglang.weights.source import CheckpointError, is_gguf

if TYPE_CHECKING:
    from kt_sglang.engine.wrapper import KTMoEWrapper

# Dense expert weights read per step when a checkpoint is quantized at load (at most the layer's
# packed bytes, so that a load's peak stays within one layer's worth of transient copies), and
# canonical matrices transcoded per step from a GGUF file: the transient copies stay this small,
# whatever the layer's size.
DENSE_STEP_BYTES = 256 * 2**20
GGUF_STEP_BYTES = 64 * 2**20


def load_layer(layer: KTMoEWrapper, physical_to_logical_map) -> None:
    """`KTMoEWrapper.load_weights`: from ``layer.weight_path``, slot e taking source expert
    ``physical_to_logical_map[e]`` (identity by default)."""
    if layer.config.file_method is not None:
        _load_gguf(layer, physical_to_logical_map)
    elif is_gguf(layer.weight_path):
        raise CheckpointError(
            f"{layer.weight_path} is a GGUF model: load it with method LLAMAFILE (each tensor is computed "
            "in its own GGUF type)"
        )
    elif is_canonical_dir(layer.weight_path):
        _load_canonical_dir(layer, physical_to_logical_map)
    else:
        _load_hf_checkpoint(layer, physical_to_logical_map)


def _read_plan(
    layer: KTMoEWrapper, physical_to_logical_map, source_experts: int
) -> tuple[list[int], list[int]]:
    """(the source experts to read: those of the held slots, each once, in order; each slot's
    position among them, 0 for a slot not held)"""
    slots = layer.slot_map(physical_to_logical_map, source_experts) or list(range(layer.num_experts))
    needed = sorted({s for e, s in enumerate(slots) if layer.holds(e)})
    position = {s: i for i, s in enumerate(needed)}
    return needed, [position.get(s, 0) if layer.holds(e) else 0 for e, s in enumerate(slots)]


def _load_read(layer: KTMoEWrapper, mats, positions: list[int]) -> None:
    """load_canonical of per-expert lists read for the held slots (positions from _read_plan)."""
    layer.load_canonical(*([m[p] if layer.holds(e) else None for e, p in enumerate(positions)] for m in mats))


def _check_model(
    layer: KTMoEWrapper, where: str, hidden: int, inter: int, experts: int, mapped: bool
) -> None:
    for name, ours, theirs in (
        ("hidden_size", layer.hidden_size, hidden),
        ("moe_intermediate_size", layer.moe_intermediate_size, inter),
    ):
        if ours != theirs:
            raise CheckpointError(f"{where}: {name} is {theirs}; this layer was built with {ours}")
    if not mapped and experts != layer.num_experts:
        raise CheckpointError(
            f"{where}: the model has {experts} experts, this layer {layer.num_experts}; "
            "pass physical_to_logical_map"
        )


def _load_hf_checkpoint(layer: KTMoEWrapper, physical_to_logical_map) -> None:
    ckpt = open_checkpoint(layer.weight_path)
    spec = ckpt.spec
    if ckpt.activation() != layer.activation:
        raise CheckpointError(
            f"{ckpt.path}: {ckpt.family.family} experts use the activation {ckpt.activation()}, which "
            f"conflicts with activation={layer.activation} given to the layer (leave it out to take the "
            "checkpoint's)"
        )
    mapped = physical_to_logical_map is not None
    _check_model(
        layer,
        str(ckpt.path / "config.json"),
        spec.hidden_size,
        spec.intermediate_size,
        spec.num_experts,
        mapped,
    )
    needed, positions = _read_plan(layer, physical_to_logical_map, spec.num_experts)
    # A method that reads the checkpoint's format takes its values as they are (no requantization);
    # from any other format the engine quantizes the dense (or dequantized) weights, if it can.
    info = METHODS[layer.method]
    in_layer = layer.layer_idx in spec.moe_layers
    fmt = ckpt.expert_format(layer.layer_idx) if in_layer else None
    if in_layer and (not info.quantizes_dense or fmt == info.checkpoint_format):
        if layer.expert_lora_path:
            raise CheckpointError(
                f"{ckpt.path}: {layer.method.value} takes the checkpoint's {fmt} values as they are; an "
                "expert adapter is merged into dense weights before quantizing: use a method the "
                "engine quantizes to"
            )
        # INT4: the group the checkpoint's config states (a format the method does not read is named
        # by layer_native_experts)
        found = ckpt.stated_group(layer.layer_idx) if fmt == info.checkpoint_format else None
        if found is not None and found != layer.group_size:
            raise CheckpointError(
                f"{ckpt.path}: its experts are quantized in groups of {found}; this layer was "
                f"built with group_size={layer.group_size} (leave it unset to take the checkpoint's)"
            )
        _load_read(layer, ckpt.layer_native_experts(layer.layer_idx, needed, layer.method), positions)
    elif in_layer and not needed:  # every expert on the GPU: nothing to read
        _load_read(layer, ([], [], []), positions)
    else:  # a few experts at a time: the dense copies never add up to a layer
        per_expert = 3 * spec.hidden_size * spec.intermediate_size * 4  # bytes, fp32 at most
        step = max(1, min(DENSE_STEP_BYTES, layer.packed_bytes) // per_expert)
        for first in range(0, len(needed), step):
            chunk = needed[first : first + step]
            gate, up, down = ckpt.layer_experts(layer.layer_idx, chunk)
            if layer.expert_lora_path:
                gate, up, down = _merge_adapter(layer, chunk, spec.num_experts, gate, up, down)
            held = range(first, first + len(chunk))  # positions of this chunk's experts
            mapping = [p - first if layer.holds(e) and p in held else -1 for e, p in enumerate(positions)]
            layer.load_weights_from_tensors(gate, up, down, mapping, partial=True)
    biases = ckpt.layer_biases(layer.layer_idx, needed) if in_layer and needed else (None, None, None)
    if any(b is not None for b in biases):
        layer.load_biases(*biases, physical_to_logical_map=positions)


def _load_gguf(layer: KTMoEWrapper, physical_to_logical_map) -> None:
    if layer.expert_lora_path:
        raise CheckpointError(
            f"{layer.weight_path}: LLAMAFILE computes the GGUF file's values as they are; an expert "
            "adapter is merged into dense weights before quantizing: use a method the engine quantizes to"
        )
    from kt_sglang.weights.gguf import open_gguf  # the gguf package, where a GGUF model loads

    model = open_gguf(layer.weight_path)
    if model.activation() != layer.activation:
        raise CheckpointError(
            f"{model.files[0]}: {model.architecture} experts use the activation {model.activation()}, "
            f"which conflicts with activation={layer.activation} given to the layer (leave it out to take "
            "the file's)"
        )
    model.check_layer(layer.layer_idx, layer.num_experts, layer.hidden_size, layer.moe_intermediate_size)
    needed, positions = _read_plan(layer, physical_to_logical_map, layer.num_experts)
    if not needed:  # every expert on the GPU: nothing to read
        _load_read(layer, ([], [], []), positions)
    step = max(1, GGUF_STEP_BYTES // (3 * layer.hidden_size * layer.moe_intermediate_size))  # ~1 B a weight
    for first in range(0, len(needed), step):  # a few experts at a time
        chunk = model.read_experts(layer.layer_idx, needed[first : first + step])
        picked = [
            p - first if layer.holds(e) and first <= p < first + step else None
            for e, p in enumerate(positions)
        ]
        layer.load_canonical(
            *([m[p] if p is not None else None for p in picked] for m in chunk), partial=True
        )
    release_freed_memory()
    biases = model.read_biases(layer.layer_idx, needed) if needed else (None, None, None)
    if any(b is not None for b in biases):
        layer.load_biases(*(torch.from_numpy(b) if b is not None else None for b in biases), positions)


def release_freed_memory() -> None:
    """Hands the heap's freed pages back to the system (glibc keeps what a load's transient copies
    freed: a GGUF layer's canonical matrices left ~1.2x its packed bytes resident otherwise)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # another C library: nothing to hand back this way
        pass


def _merge_adapter(layer: KTMoEWrapper, experts: list[int], num_experts: int, gate, up, down):
    """The experts' weights plus the adapter's scale * B A (float32), when it has this layer."""
    from kt_sglang.finetune.adapter import ExpertAdapter

    deltas = ExpertAdapter(layer.expert_lora_path).deltas(
        layer.layer_idx, experts, num_experts, layer.hidden_size, layer.moe_intermediate_size
    )
    if deltas is None:
        return gate, up, down
    return tuple((w.float() + d).contiguous() for w, d in zip((gate, up, down), deltas, strict=True))


def _load_canonical_dir(layer: KTMoEWrapper, physical_to_logical_map) -> None:
    directory = Path(layer.weight_path)
    if layer.expert_lora_path:
        raise CheckpointError(
            f"{directory} holds converted weights; an expert adapter is merged into the checkpoint's "
            "dense weights before quantizing: load from the checkpoint itself"
        )
    m = Manifest.read(directory)
    where = str(directory / MANIFEST)
    if m.method != layer.method.value or m.group_size != layer.group_size:
        raise CheckpointError(
            f"{where}: converted for {m.method} group {m.group_size}; this layer uses "
            f"{layer.method.value} group {layer.group_size} (convert again or change --kt-method)"
        )
    mapped = physical_to_logical_map is not None
    _check_model(layer, where, m.hidden_size, m.intermediate_size, m.num_experts, mapped)
    if m.layout == "packed":
        if layer.layer_idx not in m.moe_layers:
            raise CheckpointError(f"layer {layer.layer_idx} is not an MoE layer of {directory}")
        slots = layer.slot_map(physical_to_logical_map, m.num_experts) or list(range(layer.num_experts))
        slot_to_file = [s if layer.holds(e) else -1 for e, s in enumerate(slots)]
        path = directory / packed_files.packed_file(layer.layer_idx)
        header = packed_files.check_layer_file(path, m.method, m.group_size, layer.layer_idx, m.num_experts)
        packed_files.map_packed_layer(layer, path, header, slot_to_file)
        return
    needed, positions = _read_plan(layer, physical_to_logical_map, m.num_experts)
    mats = read_layer(directory, m, layer.layer_idx, needed)
    _load_read(layer, [mats[p] for p in ("gate", "up", "down")], positions)


def checkpoint_activation(weight_path: str) -> Glu:
    """The activation a Hugging Face checkpoint's or a GGUF model's experts use (plain SiLU for a
    converted directory, which records none, or a path load_weights will report on)."""

    if is_gguf(weight_path):
        from kt_sglang.weights.gguf import open_gguf

        try:
            return open_gguf(weight_path).activation()
        except (CheckpointError, OSError, ValueError):
            return SILU  # load_weights names the problem
    if is_canonical_dir(weight_path) or not (Path(weight_path) / "config.json").is_file():
        return SILU
    try:
        return open_checkpoint(weight_path).activation()
    except (CheckpointError, OSError, ValueError):
        return SILU  # load_weights names the problem


def recorded_group(weight_path: str, method) -> int | None:
    """The group a converted directory was written with, or a checkpoint's config states for the
    method that reads it as is (INT4 formats; None: neither)."""

    if is_canonical_dir(weight_path):
        manifest = Manifest.read(weight_path)
        return manifest.group_size if manifest.method == method.value else None

    info = METHODS[method]
    states = any(f.states_group for f in formats.serving(info))
    if not states or not (Path(weight_path) / "config.json").is_file():
        return None
    ckpt = open_checkpoint(weight_path)
    layers = [layer for layer in ckpt.spec.moe_layers if ckpt.expert_format(layer) == info.checkpoint_format]
    return ckpt.stated_group(layers[0]) if layers else None
