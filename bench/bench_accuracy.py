"""Fidelity of every method, deferral and hot-expert setting on the project's trained Shakespeare MoE.

    python bench/bench_accuracy.py [--windows 64] [--new-tokens 256] [--out FILE] [--plot FILE]

For each setting, on windows of the two held-out plays (see kt_sglang/shakespeare/):
- perplexity from the real SGLang server's own prompt log-probabilities, with our plugin;
- perplexity through HF transformers' forward with our layer stack (same engine, weights, deferral);
  the two must agree (the server also runs attention in bf16);
- greedy agreement with the BF16 setting over ``--new-tokens`` generated tokens per prompt: the share
  of positions with the same token, and the mean length of the identical prefix.
References: the float32 HF model (the bf16 weights, computed in float32) and SGLang serving the same
model without the plugin. Writes JSON (``--out``) and the plot of perplexity against bytes per weight.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kt_sglang.cli.server import CPU_DEVICE_ARGS, SGLangServer, free_port, server_command
from kt_sglang.engine.methods import METHODS, parse_method
from kt_sglang.layer.hf import replace_experts
from kt_sglang.shakespeare.model import MODEL_DIR, eval_windows, held_out_loss

PROMPTS = [  # speakers and opening lines; the first three are from the held-out plays
    "First Witch:\nWhen shall we three meet again\n",
    "MACBETH:\nIs this a dagger which I see before me,\n",
    "VIOLA:\n",
    "ROMEO:\nBut, soft! what light through yonder window breaks?\n",
    "HAMLET:\nTo be, or not to be: that is the question:\n",
    "GLOUCESTER:\nNow is the winter of our discontent\n",
    "PORTIA:\nThe quality of mercy is not strain'd,\n",
    "PROSPERO:\nOur revels now are ended.\n",
]


@dataclass(frozen=True)
class Setting:
    method: str | None  # None: SGLang without the plugin
    group: int | None = None
    deferred: int = 0
    hot: int = 0

    @property
    def label(self) -> str:
        if self.method is None:
            return "SGLang's own MoE (bf16)"  # the plugin loaded, no --kt-* flags
        text = self.method + (
            f" g{self.group}"
            if self.group and len(METHODS[parse_method(self.method)].allowed_groups) > 1
            else ""
        )
        if self.deferred:
            text += f", {self.deferred} deferred"
        if self.hot:
            text += f", {self.hot} hot"
        return text


def settings(num_experts: int, top_k: int) -> list[Setting]:
    out = [Setting("BF16")]
    for info in METHODS.values():  # the bf16 model: the methods that quantize it
        if info.method.value != "BF16" and info.quantizes_dense:
            out += [Setting(info.method.value, g) for g in info.allowed_groups]
    out += [Setting("BF16", deferred=d) for d in range(1, top_k)]
    out += [Setting("BF16", hot=num_experts // 4), Setting("BF16", hot=num_experts // 2), Setting(None)]
    return out


def bytes_per_weight(method: str, group: int | None) -> float:
    info = METHODS[parse_method(method)]
    g = group or info.default_group
    scale_bytes = {"AMXINT8": 2, "AMXINT4": 4, "FP8": 4 / 128, "FP8_PERCHANNEL": 0}.get(method, 0)
    return info.weight_bits / 8 + scale_bytes / g


def weight_path(setting: Setting, workdir: Path) -> Path:
    """The checkpoint itself (quantized at load) or, for a non-default group, a converted directory."""
    info = METHODS[parse_method(setting.method)]
    if setting.group in (None, info.default_group):
        return MODEL_DIR
    from kt_sglang.weights.convert_cpu import main as convert_cpu

    out = workdir / f"{setting.method}-g{setting.group}"
    if not (out / "kt_weights.json").exists():
        args = ["--input-path", str(MODEL_DIR), "--input-type", "bf16", "--output", str(out)]
        if convert_cpu(args + ["--quant-method", setting.method, "--group-size", str(setting.group)]) != 0:
            raise RuntimeError(f"converting to {setting.method} group {setting.group} failed")
    return out


def hf_loss(setting: Setting, windows, workdir: Path) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    if setting.method is not None:
        replace_experts(
            model, weight_path(setting, workdir), setting.method, setting.hot, setting.deferred, setting.group
        )
    return held_out_loss(model, windows, batch=8)


def served(setting: Setting, windows, prompts, new_tokens: int, workdir: Path, log: Path):
    """(mean held-out loss, greedy ids per prompt, seconds to start) from a real server."""
    args = list(CPU_DEVICE_ARGS)
    if setting.method is not None:
        args += ["--kt-weight-path", str(weight_path(setting, workdir)), "--kt-method", setting.method]
        args += ["--kt-cpuinfer", "2", "--kt-num-gpu-experts", str(setting.hot)]
        args += ["--kt-max-deferred-experts-per-token", str(setting.deferred)]
    port = free_port()
    started = time.perf_counter()
    with SGLangServer(server_command(MODEL_DIR, args, port), log, port) as server:
        start_s = time.perf_counter() - started
        total, count = 0.0, 0
        for i in range(0, len(windows), 16):
            batch = windows[i : i + 16]
            outs = server.post(
                "/generate",
                {
                    "input_ids": batch,
                    "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                    "return_logprob": True,
                    "logprob_start_len": 0,
                },
                timeout_s=600,
            )
            for out in outs:
                logprobs = [lp for lp, *_ in out["meta_info"]["input_token_logprobs"][1:]]
                total -= sum(logprobs)
                count += len(logprobs)
        outs = server.post(
            "/generate",
            {
                "input_ids": prompts,
                "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True},
            },
            timeout_s=600,
        )
        return total / count, [o["output_ids"] for o in outs], start_s


def agreement(ids: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    """(share of positions with the same token, mean length of the identical prefix)."""
    same = total = prefix = 0
    for a, b in zip(ids, reference, strict=True):
        same += sum(x == y for x, y in zip(a, b, strict=True))
        total += len(b)
        prefix += next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))
    return same / total, prefix / len(reference)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    points = [r for r in rows if r["bytes_per_weight"] is not None and not r["deferred"] and not r["hot"]]
    points.sort(key=lambda r: (r["bytes_per_weight"], r["increase_vs_reference"]))
    near_one = [r for r in points if 0.9 < r["bytes_per_weight"] < 1.2]  # 8-bit methods: a crowd
    for r in points:
        x, y = r["bytes_per_weight"], 100 * r["increase_vs_reference"]
        ax.plot(x, y, "o", color="C0")
        if r in near_one:  # labels stacked to the right, with a line to their point
            k = sorted(near_one, key=lambda q: q["increase_vs_reference"]).index(r)
            offset, arrow = (40, 12 * k - 4), {"arrowstyle": "-", "color": "gray", "lw": 0.5}
        else:
            offset, arrow = (5, 4), None
        ax.annotate(
            r["label"], (x, y), fontsize=7, xytext=offset, textcoords="offset points", arrowprops=arrow
        )
    ax.axhline(
        0, color="gray", ls="--", lw=1, label=f"float32 reference (perplexity {rows[0]['ppl_reference']:.2f})"
    )
    ax.set_xscale("log", base=2)
    ax.set_xlim(0.4, 3.2)
    ax.set_xlabel("bytes per expert weight, scales included (log scale)")
    ax.set_ylabel("held-out perplexity over the reference (%)")
    ax.set_title("Shakespeare MoE through the SGLang server: perplexity per method")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--windows", type=int, default=64, help="held-out windows of 256 tokens (all: 0)")
    parser.add_argument("--new-tokens", type=int, default=256, help="greedy tokens per prompt")
    parser.add_argument("--only", default=None, help="comma-separated setting labels to run (default: all)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    parser.add_argument("--plot", type=Path, default=None, help="write the plot (PNG)")
    parser.add_argument("--replot", type=Path, default=None, help="only draw --plot from this JSON")
    args = parser.parse_args(argv)
    if args.replot:
        plot(json.loads(args.replot.read_text())["rows"], args.plot)
        return 0

    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    config = AutoConfig.from_pretrained(MODEL_DIR)
    windows = eval_windows(tokenizer, 256)
    if args.windows:
        windows = windows[:: max(1, len(windows) // args.windows)][: args.windows]
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    reference = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    ref_loss = held_out_loss(reference, windows, batch=8)
    print(f"float32 reference: perplexity {math.exp(ref_loss):.4f} on {len(windows)} windows", flush=True)

    rows: list[dict] = []
    bf16_ids = None
    wanted = set(args.only.split(",")) if args.only else None
    with tempfile.TemporaryDirectory(prefix="kt-accuracy-") as tmp:
        workdir = Path(tmp)
        for setting in settings(config.num_experts, config.num_experts_per_tok):
            if wanted and setting.label not in wanted and setting != Setting("BF16"):
                continue
            t0 = time.perf_counter()
            loss, ids, start_s = served(
                setting, windows, prompts, args.new_tokens, workdir, workdir / "server.log"
            )
            hf = hf_loss(setting, windows, workdir) if setting.method is not None else None
            if setting == Setting("BF16"):
                bf16_ids = ids
            same, prefix = agreement(ids, bf16_ids)
            row = {
                **asdict(setting),
                "label": setting.label,
                "bytes_per_weight": bytes_per_weight(setting.method, setting.group)
                if setting.method
                else None,
                "ppl_reference": math.exp(ref_loss),
                "ppl_server": math.exp(loss),
                "ppl_hf": math.exp(hf) if hf is not None else None,
                "increase_vs_reference": math.exp(loss - ref_loss) - 1,
                "server_vs_hf": math.exp(loss - hf) - 1 if hf is not None else None,
                "greedy_same_tokens": same,
                "greedy_identical_prefix": prefix,
                "server_start_s": start_s,
                "seconds": time.perf_counter() - t0,
            }
            rows.append(row)
            hf_text = f"{row['ppl_hf']:.4f}" if hf is not None else "-"
            increase = 100 * row["increase_vs_reference"]
            print(
                f"{row['label']:<28} server {row['ppl_server']:.4f} ({increase:+.2f}%)  hf {hf_text}"
                f"  greedy same {100 * same:.1f}%  prefix {prefix:.0f}  ({row['seconds']:.0f} s)",
                flush=True,
            )
    result = {
        "model": str(MODEL_DIR),
        "windows": len(windows),
        "tokens": len(windows) * 255,
        "prompts": PROMPTS,
        "new_tokens": args.new_tokens,
        "rows": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
