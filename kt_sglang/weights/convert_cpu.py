"""`kt-sglang convert-cpu`: quantize a checkpoint's experts once into the canonical CPU format.

An FP8 checkpoint converted for a method that stores e4m3 weights is copied, not quantized: its
weights and scales go into the canonical files as they are (bf16 scales as the same fp32 values).

Streams layer by layer (peak memory: one layer's experts plus its output), writes each layer under a
temporary name and renames it, and on a rerun (or with --resume-layer) skips the layers already
complete after checking them; then merges the layer files into shards with an index (unless
--no-merge-safetensor). With --layout packed it writes one file per layer in the engine's packed
layout instead (weights/packed_files.py), never merged: a layer computes from the mapped file.
The flags are kt-kernel's, so existing commands carry over.
"""

from __future__ import annotations

import argparse
import collections
import errno
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from kt_sglang.engine.activation import SILU
from kt_sglang.engine.canonical import quantize
from kt_sglang.engine.methods import METHODS, Method, method_names, parse_method, resolve_group
from kt_sglang.weights.canonical_files import (
    INDEX,
    LAYOUTS,
    MANIFEST,
    Manifest,
    clean_leftovers,
    dtype_name,
    expert_bytes,
    format_size,
    layer_is_complete,
    merge_layers,
    read_index,
    sha256_text,
    write_layer,
)
from kt_sglang.weights.checkpoint import Checkpoint, CheckpointError
from kt_sglang.weights.packed_files import packed_file, write_packed_layer

# --input-type: the experts' stored form, as each format names it (ExpertFormat.kt_input_type). "int4"
# is either INT4 format (compressed-tensors pack-quantized, GPTQ), "fp4" MXFP4 or NVFP4, told apart
# by the tensors' names and dtypes.
INPUT_TYPES = ("bf16", "fp16", "fp8", "int4", "fp4")


def _method_arg(name: str) -> Method:
    try:
        return parse_method(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def build_parser(prog: str = "kt-sglang convert-cpu") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--input-path", required=True, help="Hugging Face model directory")
    p.add_argument(
        "--input-type",
        default=None,
        choices=INPUT_TYPES,
        help="form of the expert tensors (default: what the checkpoint holds; given, it is checked)",
    )
    p.add_argument("--output", required=True, help="output directory (canonical format)")
    p.add_argument(
        "--quant-method",
        required=True,
        type=_method_arg,
        metavar="METHOD",
        help="the --kt-method the output serves: " + ", ".join(method_names()) + " (kt-kernel's int4 / int8 "
        "name AMXINT4 / AMXINT8)",
    )
    p.add_argument(
        "--group-size", type=int, default=None, help="quantization group (default: the method's own)"
    )
    p.add_argument(
        "--cpuinfer-threads",
        type=int,
        default=None,
        help="threads quantizing, 1..physical cores (default: all physical cores)",
    )
    p.add_argument(
        "--threadpool-count",
        type=int,
        default=1,
        help="accepted for kt-kernel compatibility; the output does not depend on NUMA "
        "(the engine repacks per node at load)",
    )
    p.add_argument(
        "--layout",
        choices=LAYOUTS,
        default="canonical",
        help="canonical (default): safetensors files in an ISA-independent layout, repacked at load; "
        "packed: one file per layer in the engine's packed layout (the same on every ISA), which a "
        "layer on one pool computes from memory-mapped, without a copy (restarts read from the page cache)",
    )
    p.add_argument(
        "--no-merge-safetensor",
        action="store_true",
        help="keep one file per layer (loads as is) instead of merging them into shards of whole "
        "layers with an index; the merge holds one shard (up to 2 GiB) in memory",
    )
    p.add_argument(
        "--resume-layer", type=int, default=None, help="start at this layer (earlier ones are checked)"
    )
    return p


def _holds_model(directory: Path) -> bool:
    """A model checkpoint's directory: config.json with safetensors (not one of our converted ones)."""
    if not (directory / "config.json").is_file() or (directory / MANIFEST).is_file():
        return False
    return (directory / INDEX).is_file() or any(directory.glob("*.safetensors"))


def check_output(input_path: Path, output: Path) -> None:
    """Refuses an output that is, contains or is inside a model directory: the merged index would
    take the place of the model's own (SGLang then loads none of its weights)."""
    inp, out = input_path.resolve(), output.resolve()
    problem = None
    if out == inp:
        problem = "is the input checkpoint"
    elif inp in out.parents:
        problem = f"is inside the input checkpoint {inp}"
    elif out in inp.parents:
        problem = f"contains the input checkpoint {inp}"
    elif _holds_model(out):
        problem = "holds a model (config.json and *.safetensors)"
    elif holder := next((p for p in out.parents if _holds_model(p)), None):
        problem = f"is inside the model directory {holder}"
    elif out.is_dir() and (inner := next((d for d in out.iterdir() if _holds_model(d)), None)):
        problem = f"contains the model directory {inner}"
    if problem:
        raise ValueError(
            f"--output {output} {problem}: write the converted experts to a directory of their own"
        )


def check_free_space(out: Path, manifest: Manifest, layers: int, merge: bool, one: int | None = None) -> None:
    """``one``: bytes an expert takes (default: its canonical tensors)."""
    if one is None:
        one = expert_bytes(
            Method(manifest.method), manifest.group_size, manifest.hidden_size, manifest.intermediate_size
        )
    layer_bytes = manifest.num_experts * one
    need = layers * layer_bytes + (len(manifest.moe_layers) * layer_bytes if merge else 0)
    free = shutil.disk_usage(out).free
    if need > free:
        merging = (
            " (the merge writes the shards before it removes the layer files; --no-merge-safetensor "
            f"needs {format_size(layers * layer_bytes)})"
            if merge
            else ""
        )
        raise OSError(
            errno.ENOSPC, f"{out} has {format_size(free)} free; converting needs {format_size(need)}{merging}"
        )


def convert(args: argparse.Namespace) -> Path:
    from kt_sglang.engine.pools import check_thread_count, physical_cores

    threads = physical_cores() if args.cpuinfer_threads is None else args.cpuinfer_threads
    check_thread_count(threads, "--cpuinfer-threads")
    check_output(Path(args.input_path), Path(args.output))
    ckpt = Checkpoint(args.input_path)
    spec = ckpt.spec
    method = args.quant_method
    first = spec.moe_layers[0] if spec.moe_layers else None
    if first is None:
        raise CheckpointError(f"{args.input_path} has no MoE layers")
    fmt = ckpt.layer_format(first)
    found = fmt.kt_input_type(ckpt, first)
    if found is None:
        raise CheckpointError(
            f"{args.input_path}: experts are {dtype_name(ckpt.expert_dtype(first))}, "
            f"not {', '.join(INPUT_TYPES)}"
        )
    if args.input_type is not None and args.input_type != found:
        raise CheckpointError(
            f"--input-type {args.input_type} does not match the checkpoint: its experts are {found}"
        )
    args.input_type = found
    # A method that reads the checkpoint's format keeps its values as they are: the output is a
    # cache of the checkpoint's experts in the canonical layout, not a requantization.
    if any(b is not None for b in ckpt.layer_biases(first, [0])) or ckpt.activation() != SILU:
        raise CheckpointError(
            f"{args.input_path}: {ckpt.family.family} experts have biases or the activation "
            f"{ckpt.activation()}, which converted directories do not record; serve the checkpoint "
            "itself (--kt-weight-path <its directory>)"
        )
    as_is = METHODS[method].checkpoint_format == fmt.name
    stated = ckpt.stated_group(first) if as_is else None  # INT4: the group the config states
    if args.group_size is None:
        args.group_size = stated
    group = resolve_group(method, args.group_size)
    if as_is or not METHODS[method].quantizes_dense:
        # names, dtypes, scales, block or group size: fail before writing
        mats = ckpt.layer_native_experts(first, [0], method)
        if stated is not None and stated != group:
            raise CheckpointError(
                f"--group-size {group} does not match the checkpoint's group size "
                f"{stated} ({method.value} keeps the checkpoint's values)"
            )
        del mats
    layers = list(spec.moe_layers)
    if args.resume_layer is not None:
        if args.resume_layer > layers[-1]:
            raise ValueError(f"--resume-layer {args.resume_layer} is past the last MoE layer ({layers[-1]})")
        layers = [layer for layer in layers if layer >= args.resume_layer]
    config_text = (ckpt.path / "config.json").read_text()
    manifest = Manifest(
        method=method.value,
        group_size=group,
        model_type=str(ckpt.config.get("model_type")),
        num_layers=spec.num_layers,
        moe_layers=list(spec.moe_layers),
        num_experts=spec.num_experts,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        source_dtype=args.input_type,
        source_config_sha256=sha256_text(config_text),
        source_tensors_sha256=sha256_text("\n".join(ckpt.expert_tensor_names())),
        layout=args.layout,
    )
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    if (out / MANIFEST).is_file():
        existing = Manifest.read(out)
        if existing != manifest:
            raise ValueError(
                f"{out} holds a conversion of another model or method ({existing.model_type}, "
                f"{existing.method} group {existing.group_size}); use an empty output directory"
            )
    else:
        manifest.write(out)
    for path in clean_leftovers(out, manifest):
        print(f"removed {path.name}, left by an interrupted run")
    todo = [layer for layer in layers if not layer_is_complete(out, manifest, layer)]
    packer = _packer(manifest, threads) if args.layout == "packed" else None
    merge = packer is None and not args.no_merge_safetensor and read_index(out) is None
    check_free_space(out, manifest, len(todo), merge, sum(packer.packed_file_bytes()) if packer else None)
    skipped = len(layers) - len(todo)
    written = 0
    bar = tqdm(total=len(todo) * spec.num_experts, unit="expert", desc="convert-cpu", dynamic_ncols=True)
    # the native quantizer releases the GIL; the bar closes before any error is printed
    with bar, ThreadPoolExecutor(max_workers=threads) as pool:
        for layer in todo:
            bar.set_postfix_str(
                f"layer {layer}, {written / 2**30:.2f} GiB written, {skipped} complete before"
            )

            def one(weights: tuple) -> dict:
                mats = {
                    p: quantize(method, w, group)
                    for p, w in zip(("gate", "up", "down"), weights, strict=True)
                }
                bar.update(1)
                return mats

            if as_is:
                experts = []
                for mats in ckpt.iter_native_experts(layer, method):
                    experts.append(dict(zip(("gate", "up", "down"), mats, strict=True)))
                    bar.update(1)
                written += _write(out, manifest, layer, experts, packer)
                del experts
                continue
            # Experts stream through the pool, at most 2 per thread in flight besides the output
            # (Executor.map would read the whole layer first).
            experts, in_flight = [], collections.deque()
            for weights in ckpt.iter_experts(layer):
                in_flight.append(pool.submit(one, weights))
                if len(in_flight) >= 2 * threads:
                    experts.append(in_flight.popleft().result())
            experts += [f.result() for f in in_flight]
            written += _write(out, manifest, layer, experts, packer)
            del experts
    merged = ""
    if merge:
        shards = merge_layers(out, manifest)
        merged = f", merged into {len(shards)} shard(s) with {INDEX}"
    print(f"wrote {out} ({len(todo)} layers converted, {skipped} already complete{merged})")
    return out


def _packer(manifest: Manifest, threads: int):
    """A layer holding every expert: it packs each converted layer for the file (whatever its pools:
    export_packed gathers their slices). In a process whose pools are started, on those pools."""
    from kt_sglang.engine.base import BaseMoEWrapper
    from kt_sglang.engine.config import MoEConfig
    from kt_sglang.engine.pools import SharedRunner

    started = SharedRunner.current()
    pools = {"cpuinfer_threads": threads, "threadpool_count": 1}
    if started is not None:
        pools = {"cpuinfer_threads": started.threads, "threadpool_count": started.pools}
        pools["numa_nodes"] = list(started.nodes)
    config = MoEConfig(
        layer_idx=0,
        num_experts=manifest.num_experts,
        num_experts_per_tok=1,
        hidden_size=manifest.hidden_size,
        moe_intermediate_size=manifest.intermediate_size,
        gpu_experts_mask=None,
        method=manifest.method,
        group_size=manifest.group_size,
        **pools,
    )
    return BaseMoEWrapper(config)


def _write(out: Path, manifest: Manifest, layer: int, experts: list[dict], packer) -> int:
    """Writes one converted layer in the manifest's layout; returns its bytes."""
    if packer is None:
        return write_layer(out, manifest, layer, experts).stat().st_size
    packer.load_canonical(*([x[p] for x in experts] for p in ("gate", "up", "down")))
    return write_packed_layer(packer, out / packed_file(layer), layer)


def main(argv: list[str] | None = None, prog: str = "kt-sglang convert-cpu") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        convert(args)
    except (ValueError, OSError) as exc:  # CheckpointError is a ValueError
        ours = isinstance(exc, OSError) and exc.filename is None and exc.strerror  # no "[Errno N]"
        print(f"error: {exc.strerror if ours else exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "\ninterrupted: the layers written so far are kept; rerun the same command to resume",
            file=sys.stderr,
        )
        return 130
    return 0
