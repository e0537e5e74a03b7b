"""Trains the project's small Shakespeare MoE from scratch on this CPU: tokenizer, model, loss curve.

    python -m kt_sglang.shakespeare.train --out kt_sglang/shakespeare/model --plot docs/shakespeare-loss.png

Deterministic (seeded data order and initialization, a fixed number of steps): two runs on the same
machine and library versions write the same files (tested on a short run). The plays of
``HELD_OUT_PLAYS`` are never seen; their loss is recorded in ``training.json`` next to the weights,
with the per-expert load and the commit of this script.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import time
from pathlib import Path

import torch

from kt_sglang.shakespeare.corpus import HELD_OUT_PLAYS, play_text, training_plays
from kt_sglang.shakespeare.model import (
    ModelSpec,
    build_config,
    eval_windows,
    held_out_loss,
    save_model,
)
from kt_sglang.tokenizer import BOS, train_bpe_tokenizer


def _lr(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _expert_load(model, windows: list[list[int]], top_k: int) -> list[list[float]]:
    """Per layer, the share of (token, expert) routings each expert receives on ``windows``."""
    counts: list[torch.Tensor] = []
    with torch.no_grad():
        for start in range(0, len(windows), 32):
            batch = torch.tensor(windows[start : start + 32])
            out = model(batch, output_router_logits=True)
            for layer, logits in enumerate(out.router_logits):
                hits = torch.bincount(
                    logits.topk(top_k, dim=-1).indices.flatten(), minlength=logits.shape[-1]
                )
                if layer == len(counts):
                    counts.append(torch.zeros_like(hits))
                counts[layer] += hits
    return [(c / c.sum()).tolist() for c in counts]


def _commit() -> str:
    try:
        here = Path(__file__).parent
        rev = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, check=True
        )
        status = ["git", "status", "--porcelain", "--", ".", ":(exclude)model"]  # not the model it writes
        dirty = subprocess.run(status, cwd=here, capture_output=True, text=True)
        return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def train(out: Path, spec: ModelSpec, steps: int, batch: int, lr: float, plot: Path | None) -> dict:
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    torch.manual_seed(spec.seed)
    torch.use_deterministic_algorithms(True)  # the experts' scatter-adds otherwise sum in thread order
    torch.set_num_threads(os.cpu_count() or 1)
    out.mkdir(parents=True, exist_ok=True)
    train_texts = [play_text(p) for p in training_plays()]
    tokenizer = train_bpe_tokenizer(train_texts, spec.vocab_size, out)
    bos = tokenizer.convert_tokens_to_ids(BOS)
    stream = torch.tensor(
        [t for text in train_texts for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
    )
    held_out = eval_windows(tokenizer, spec.context)
    print(
        f"training tokens: {len(stream)}; held-out windows: {len(held_out)} from {', '.join(HELD_OUT_PLAYS)}"
    )

    config = build_config(spec, tokenizer)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    print(f"parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M")
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    optim = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )
    data_gen = torch.Generator().manual_seed(spec.seed)
    probe = held_out[:: max(1, len(held_out) // 24)]  # a fixed sample of held-out windows for the curve
    curve: dict[str, list] = {"step": [], "train_loss": [], "eval_step": [], "held_out_loss": []}
    start = time.perf_counter()
    model.train()
    bar = tqdm(range(steps), desc="training", unit="step")
    for step in bar:
        starts = torch.randint(0, len(stream) - spec.context, (batch,), generator=data_gen)
        windows = torch.stack([stream[s : s + spec.context - 1] for s in starts.tolist()])
        ids = torch.cat([torch.full((batch, 1), bos), windows], dim=1)
        for group in optim.param_groups:
            group["lr"] = _lr(step, steps, lr, warmup=max(1, steps // 20))
        result = model(ids, labels=ids, output_router_logits=True)
        optim.zero_grad(set_to_none=True)
        result.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        lm_loss = (result.loss - config.router_aux_loss_coef * result.aux_loss).item()
        curve["step"].append(step)
        curve["train_loss"].append(lm_loss)
        if step % 100 == 99 or step == steps - 1:
            model.eval()
            curve["eval_step"].append(step)
            curve["held_out_loss"].append(held_out_loss(model, probe))
            model.train()
            bar.set_postfix(train=f"{lm_loss:.3f}", held_out=f"{curve['held_out_loss'][-1]:.3f}")
    minutes = (time.perf_counter() - start) / 60
    model.eval()

    save_model(model, tokenizer, config, out)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    record = {
        "trained_by": "kt_sglang/shakespeare/train.py",
        "commit": _commit(),
        "torch": torch.__version__,
        "spec": spec.__dict__,
        "steps": steps,
        "batch": batch,
        "peak_lr": lr,
        "training_minutes": round(minutes, 1),
        "training_tokens_seen": steps * batch * spec.context,
        "held_out_plays": list(HELD_OUT_PLAYS),
        "held_out_windows": len(held_out),
        "held_out_loss": held_out_loss(reloaded, held_out),  # of the saved bf16 weights, in float32
        "expert_load": _expert_load(reloaded, held_out, spec.top_k),
        "curve": curve,
    }
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    if plot is not None:
        _plot(curve, plot)
    return record


def _plot(curve: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    window = 25
    smooth = [
        sum(curve["train_loss"][max(0, i - window + 1) : i + 1])
        / len(curve["train_loss"][max(0, i - window + 1) : i + 1])
        for i in range(len(curve["train_loss"]))
    ]
    ax.plot(curve["step"], smooth, label="training plays (mean of 25 steps)")
    ax.plot(
        curve["eval_step"],
        curve["held_out_loss"],
        "o-",
        label="held-out plays (" + ", ".join(HELD_OUT_PLAYS) + ")",
    )
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.set_title("Shakespeare MoE: training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out", type=Path, required=True, help="directory for the model, tokenizer and training.json"
    )
    parser.add_argument("--steps", type=int, default=ModelSpec.steps)
    parser.add_argument("--batch", type=int, default=ModelSpec.batch)
    parser.add_argument("--lr", type=float, default=ModelSpec.peak_lr)
    parser.add_argument("--plot", type=Path, default=None, help="write the loss curve here (PNG)")
    args = parser.parse_args(argv)
    record = train(args.out, ModelSpec(), args.steps, args.batch, args.lr, args.plot)
    loss, minutes = record["held_out_loss"], record["training_minutes"]
    print(f"held-out loss {loss:.4f} after {minutes} minutes; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
