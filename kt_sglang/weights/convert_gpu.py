"""`kt-sglang convert-gpu`: quantize a MoE model's routed experts for SGLang's GPU side.

Runs llmcompressor (compressed-tensors W4A16 or W8A16, by GPTQ with calibration data or by RTN) on
the routed experts' Linear layers only: attention, router gates, shared experts, dense MLP layers
and lm_head stay in full precision. The output is a Hugging Face model directory that SGLang serves
as a compressed-tensors checkpoint and transformers reloads. The flags are kt-kernel's, so existing
commands carry over. llmcompressor pins its own torch and transformers versions: install it in an
environment of its own (``pip install 'kt-sglang[convert-gpu]'``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path

INSTALL_HINT = (
    "kt-sglang convert-gpu needs llmcompressor: pip install 'kt-sglang[convert-gpu]' in an environment "
    "of its own (llmcompressor pins torch and transformers versions other than SGLang's)"
)
# Routed experts once llmcompressor has linearized them: `...experts.{e}.{gate,up,down}_proj`,
# Mixtral's `...experts.{e}.{w1,w2,w3}`.
ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.[^.]+$")
# Full-precision modules named by pattern; any other non-expert Linear is listed by name.
KEEP_PATTERNS = ("lm_head", r"re:.*self_attn\..*", r"re:.*shared_experts?\..*", r"re:.*\.gate$")
GROUP_SIZE = 128  # compressed-tensors' W4A16 / W8A16 presets quantize in groups of 128 inputs


def build_parser(prog: str = "kt-sglang convert-gpu") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--model_id", required=True, help="Hugging Face model directory (or hub id)")
    p.add_argument("--output_dir", required=True, help="output directory (must not exist or be empty)")
    p.add_argument("--quant_method", choices=("GPTQ", "RTN"), default="GPTQ")
    p.add_argument("--quant_type", choices=("W4A16", "W8A16"), default="W4A16")
    p.add_argument("--num_calibration_samples", type=int, default=512)
    p.add_argument("--max_sequence_length", type=int, default=2048)
    p.add_argument(
        "--dataset",
        default=None,
        help="calibration data for GPTQ: a local .jsonl (rows with 'text' or chat 'messages') or .txt "
        "(samples separated by blank lines) file, or a hub dataset id",
    )
    p.add_argument("--dataset_split", default="train_sft", help="split of a hub dataset")
    p.add_argument("--dampening_frac", type=float, default=0.1, help="GPTQ Hessian dampening")
    p.add_argument("--max_gpu_memory", default=None, help="e.g. 70GiB: GPU 0's share when loading")
    p.add_argument("--max_cpu_memory", default=None, help="e.g. 200GiB: CPU memory when loading")
    p.add_argument("--force_cpu", action="store_true", help="load and calibrate on the CPU")
    p.add_argument("--trust_remote_code", action="store_true")
    return p


def full_precision_modules(linear_names: list[str]) -> list[str]:
    """The ignore list: patterns for the usual modules, the names of any other non-expert Linear."""
    patterns = [re.compile(p[3:] if p.startswith("re:") else re.escape(p) + "$") for p in KEEP_PATTERNS]
    experts = [n for n in linear_names if ROUTED_EXPERT.search(n)]
    if not experts:
        raise ValueError(
            "no routed-expert Linear layers found: is this a MoE model llmcompressor can linearize?"
        )
    caught = [n for n in experts if any(p.fullmatch(n) for p in patterns)]
    if caught:
        raise AssertionError(f"full-precision patterns would skip routed experts, e.g. {caught[0]}")
    others = [
        n for n in linear_names if not ROUTED_EXPERT.search(n) and not any(p.fullmatch(n) for p in patterns)
    ]
    return [*KEEP_PATTERNS, *sorted(others)]


def restore_expert_names(directory: Path, model_type: str) -> int:
    """llmcompressor saves linearized experts as `...experts.{e}.{gate,up,down}_proj.*`; SGLang and
    transformers read the family's own names (Mixtral's w1 / w3 / w2, configs/models). Renames the
    saved tensors in place, shard by shard; returns how many were renamed."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from kt_sglang.weights.families import family_for

    renames = []
    for proj, template in family_for(model_type).experts.items():
        module = template.removesuffix(".weight")
        module = module[module.index("layers.") :]  # any prefix (model., model.language_model.)
        saved = module.rsplit(".", 1)[0] + f".{proj}_proj"
        if saved != module:
            pattern = re.escape(saved.format(layer="LAYER", expert="EXPERT"))
            pattern = pattern.replace("LAYER", r"(?P<layer>\d+)").replace("EXPERT", r"(?P<expert>\d+)")
            renames.append((re.compile(r"^(?P<prefix>.*)" + pattern + r"\.(?P<suffix>[^.]+)$"), module))

    def renamed(name: str) -> str:
        for pattern, module in renames:
            m = pattern.match(name)
            if m:
                target = module.format(layer=m["layer"], expert=m["expert"])
                return f"{m['prefix']}{target}.{m['suffix']}"
        return name

    count = 0
    if not renames:
        return count
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            metadata = f.metadata()
        tensors = load_file(shard)
        new = {renamed(k): v for k, v in tensors.items()}
        changed = sum(1 for a, b in zip(tensors, new, strict=True) if a != b)
        if changed:
            tmp = shard.with_name(shard.name + ".tmp")
            save_file(new, str(tmp), metadata=metadata)
            os.replace(tmp, shard)
            count += changed
    index = directory / "model.safetensors.index.json"
    if count and index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {renamed(k): v for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data, indent=2))
    return count


def calibration_texts(dataset: str, split: str, tokenizer, limit: int) -> list[str]:
    """Calibration samples as text: chat rows through the model's chat template."""

    def row_text(row: dict, where: str) -> str:
        if "messages" in row:
            return tokenizer.apply_chat_template(row["messages"], tokenize=False)
        if "text" in row:
            return str(row["text"])
        raise ValueError(f"{where}: a row has neither 'text' nor 'messages' (keys: {sorted(row)})")

    path = Path(dataset)
    if path.is_file():
        if path.suffix in (".jsonl", ".json"):
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            texts = [row_text(row, str(path)) for row in rows]
        else:
            texts = [t.strip() for t in re.split(r"\n\s*\n", path.read_text()) if t.strip()]
    else:
        import datasets

        rows = datasets.load_dataset(dataset, split=split)
        texts = [row_text(row, dataset) for row in rows.select(range(min(limit, len(rows))))]
    if not texts:
        raise ValueError(f"{dataset}: no calibration samples")
    return texts[:limit]


def convert(args: argparse.Namespace) -> Path:
    try:
        import torch
        from llmcompressor import oneshot
        from llmcompressor.modeling.moe.linearize import load_quantizable_moe
        from llmcompressor.modifiers.gptq import GPTQModifier
        from llmcompressor.modifiers.quantization import QuantizationModifier
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise RuntimeError(f"{INSTALL_HINT} ({exc})") from None

    out = Path(args.output_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty: choose a new --output_dir")
    if args.quant_method == "GPTQ" and not args.dataset:
        raise ValueError(
            "GPTQ needs calibration data: --dataset FILE.jsonl|FILE.txt (or use --quant_method RTN)"
        )
    on_cpu = args.force_cpu or not torch.cuda.is_available()
    max_memory = None
    if not on_cpu and (args.max_gpu_memory or args.max_cpu_memory):
        max_memory = {k: v for k, v in ((0, args.max_gpu_memory), ("cpu", args.max_cpu_memory)) if v}
    with load_quantizable_moe():  # fused experts become one Linear per expert and projection
        model = AutoModelForCausalLM.from_pretrained(
            args.model_id,
            dtype="auto",
            device_map="cpu" if on_cpu else "auto",
            max_memory=max_memory,
            trust_remote_code=args.trust_remote_code,
        )
    tokenizer = AutoTokenizer.from_pretrained(args.model_id, trust_remote_code=args.trust_remote_code)
    modules = dict(model.named_modules())
    linear = [n for n, m in modules.items() if isinstance(m, torch.nn.Linear)]
    ignore = full_precision_modules(linear)
    for name in linear:
        if ROUTED_EXPERT.search(name) and modules[name].in_features % GROUP_SIZE:
            raise ValueError(
                f"{name} has {modules[name].in_features} input features, not a multiple of the "
                f"{args.quant_type} group size {GROUP_SIZE}: this model's experts cannot use the preset"
            )
    if args.quant_method == "GPTQ":
        recipe = GPTQModifier(
            targets="Linear", scheme=args.quant_type, ignore=ignore, dampening_frac=args.dampening_frac
        )
        texts = calibration_texts(args.dataset, args.dataset_split, tokenizer, args.num_calibration_samples)
        import datasets

        dataset = datasets.Dataset.from_dict({"text": texts}).map(
            lambda row: tokenizer(row["text"], truncation=True, max_length=args.max_sequence_length),
            remove_columns=["text"],
        )
        oneshot(
            model=model,
            dataset=dataset,
            recipe=recipe,
            max_seq_length=args.max_sequence_length,
            num_calibration_samples=len(texts),
        )
    else:
        oneshot(
            model=model, recipe=QuantizationModifier(targets="Linear", scheme=args.quant_type, ignore=ignore)
        )
    # Written under a temporary name and renamed: an interrupted run leaves no directory that looks done.
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, save_compressed=True)
    tokenizer.save_pretrained(tmp)
    restore_expert_names(tmp, model.config.model_type)
    if out.exists():
        out.rmdir()
    os.replace(tmp, out)
    experts = sum(1 for n in linear if ROUTED_EXPERT.search(n))
    print(f"wrote {out} ({args.quant_method} {args.quant_type} on {experts} expert Linear layers)")
    return out


def main(argv: list[str] | None = None, prog: str = "kt-sglang convert-gpu") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        convert(args)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
