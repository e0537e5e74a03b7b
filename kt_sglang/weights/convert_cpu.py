"""`kt-sglang convert-cpu`: quantize a checkpoint's experts once into the canonical CPU format.

An FP8 checkpoint converted for a method that stores e4m3 weights is copied, not quantized: its
weights and scales go into the canonical files as they are (bf16 scales as the same fp32 values).

Streams layer by layer (peak memory: one layer's experts plus its output), writes each layer under a
temporary name and renames it, and on a rerun (or with --resume-layer) skips the layers already
complete after checking them; then merges the layer files into shards with an index (unless
--no-merge-safetensor). The flags are kt-kernel's, so existing commands carry over.
"""

from __future__ import annotations

import argparse
import collections
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm import tqdm

from kt_sglang.engine.canonical import quantize
from kt_sglang.engine.methods import METHODS, Method, method_names, parse_method, resolve_group
from kt_sglang.weights.canonical_files import (
    INDEX,
    MANIFEST,
    Manifest,
    dtype_name,
    layer_is_complete,
    merge_layers,
    read_index,
    sha256_text,
    write_layer,
)
from kt_sglang.weights.checkpoint import Checkpoint, CheckpointError, is_float8

INPUT_TYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}


def _method_arg(name: str) -> Method:
    try:
        return parse_method(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def build_parser(prog: str = "kt-sglang convert-cpu") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--input-path", required=True, help="Hugging Face model directory")
    p.add_argument(
        "--input-type", required=True, choices=sorted(INPUT_TYPES), help="dtype of the expert tensors"
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
        "--cpuinfer-threads", type=int, default=None, help="threads quantizing (default: all cores)"
    )
    p.add_argument(
        "--threadpool-count",
        type=int,
        default=1,
        help="accepted for kt-kernel compatibility; the output does not depend on NUMA "
        "(the engine repacks per node at load)",
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


def convert(args: argparse.Namespace) -> Path:
    from kt_sglang.engine.pools import physical_cores

    ckpt = Checkpoint(args.input_path)
    spec = ckpt.spec
    method = args.quant_method
    group = resolve_group(method, args.group_size)
    first = spec.moe_layers[0] if spec.moe_layers else None
    if first is None:
        raise CheckpointError(f"{args.input_path} has no MoE layers")
    found = ckpt.expert_dtype(first)
    if found != INPUT_TYPES[args.input_type]:
        raise CheckpointError(
            f"--input-type {args.input_type} does not match the checkpoint: "
            f"its experts are {dtype_name(found)}"
        )
    # A method storing e4m3 weights keeps an FP8 checkpoint's values as they are: the output is a
    # cache of the checkpoint's experts in the canonical layout, not a requantization.
    as_is = METHODS[method].tensors[0].dtype == torch.float8_e4m3fn and is_float8(found)
    if as_is:
        ckpt.layer_fp8_experts(first, [0], method)  # names, dtypes, scales, block size: fail before writing
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
    threads = args.cpuinfer_threads or physical_cores()
    todo = [layer for layer in layers if not layer_is_complete(out, manifest, layer)]
    skipped = len(layers) - len(todo)
    bar = tqdm(total=len(todo) * spec.num_experts, unit="expert", desc="convert-cpu", dynamic_ncols=True)
    written = 0
    with ThreadPoolExecutor(max_workers=threads) as pool:  # the native quantizer releases the GIL
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
                for mats in ckpt.iter_fp8_experts(layer, method):
                    experts.append(dict(zip(("gate", "up", "down"), mats, strict=True)))
                    bar.update(1)
                written += write_layer(out, manifest, layer, experts).stat().st_size
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
            written += write_layer(out, manifest, layer, experts).stat().st_size
            del experts
    bar.close()
    merged = ""
    if not args.no_merge_safetensor and read_index(out) is None:
        shards = merge_layers(out, manifest)
        merged = f", merged into {len(shards)} shard(s) with {INDEX}"
    print(f"wrote {out} ({len(todo)} layers converted, {skipped} already complete{merged})")
    return out


def main(argv: list[str] | None = None, prog: str = "kt-sglang convert-cpu") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        convert(args)
    except (ValueError, OSError) as exc:  # CheckpointError is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
