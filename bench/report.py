"""Turns benchmark JSON files into the table and plot of docs/benchmarks.md.

    python bench/report.py bench/results/moe-layer.json

Needs matplotlib (`pip install 'kt-sglang[dev]'`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _ms(points: dict, tokens: str) -> str:
    return f"{points[tokens]['ms']:.2f}" if tokens in points else "-"


def _ratio(point: dict, key: str) -> str:
    return f"{point[key]:.2f}x" if key in point else "-"


def table(results: list[dict]) -> str:
    lines = [
        "| layer | method | threads | decode T=1 ms (% read BW) | T=4 ms | T=16 ms "
        "| prefill tok/s 128 / 512 / 2048 | eff. TOPS at 2048 | x torch loop at 2048 "
        "| x kt-kernel T=1 / 2048 | rel. error |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        for r in res["rows"]:
            d, p = r["decode"], r["prefill"]

            t1 = f"{d['1']['ms']:.2f} ({100 * d['1']['bw_fraction']:.0f}%)" if "1" in d else "-"
            pre = " / ".join(f"{p[t]['tokens_per_s']:.0f}" for t in ("128", "512", "2048") if t in p)
            tops = f"{p['2048']['tops']:.2f}" if "2048" in p else "-"
            loop = _ratio(p.get("2048", {}), "vs_baseline")
            kt = f"{_ratio(d.get('1', {}), 'vs_kt_kernel')} / {_ratio(p.get('2048', {}), 'vs_kt_kernel')}"
            err = f"{r['rel_error']:.4f}" if "rel_error" in r else "-"
            lines.append(
                f"| {r['layer']} | {r['method']} | {r['threads']} | {t1} | {_ms(d, '4')} | {_ms(d, '16')} "
                f"| {pre} | {tops} | {loop} | {kt} | {err} |"
            )
    return "\n".join(lines)


def kt_kernel_table(results: list[dict]) -> str:
    """Every point run side by side with kt-kernel (`--kt-kernel-python`): our speed over its."""
    lines = [
        "| layer | method | decode T=1 / 4 / 16: x kt-kernel (its ms) "
        "| prefill 128 / 512 / 2048: x kt-kernel (its tok/s) |",
        "|---|---|---|---|",
    ]
    for res in results:
        for r in res["rows"]:
            d, p = r["decode"], r["prefill"]
            if not any("vs_kt_kernel" in v for v in (*d.values(), *p.values())):
                continue
            dec = " / ".join(f"{v['vs_kt_kernel']:.2f}x ({v['kt_kernel_ms']:.2f})" for v in d.values())
            pre = " / ".join(
                f"{v['vs_kt_kernel']:.2f}x ({int(t) / v['kt_kernel_ms'] * 1e3:.0f})" for t, v in p.items()
            )
            lines.append(f"| {r['layer']} | {r['method']} | {dec} | {pre} |")
    return "\n".join(lines)


def plot(results: list[dict], out: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for res in results:
        for r in res["rows"]:
            if r["threads"] != max(int(t) for t in res["bandwidth_gbs"]):
                continue
            label = f"{r['layer']} {r['method']}"
            d = sorted((int(t), v["bw_fraction"] * 100) for t, v in r["decode"].items())
            p = sorted((int(t), v["tokens_per_s"]) for t, v in r["prefill"].items())
            axes[0].plot(*zip(*d, strict=True), marker="o", label=label)
            axes[1].plot(*zip(*p, strict=True), marker="o", label=label)
    axes[0].set(xscale="log", xlabel="decode tokens", ylabel="% of measured read bandwidth", ylim=(0, 130))
    axes[1].set(xscale="log", yscale="log", xlabel="prefill tokens", ylabel="tokens / s")
    axes[0].axhline(80, color="gray", linestyle="--", linewidth=1)
    for ax in axes:
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes[1].legend(fontsize=7)
    fig.suptitle("kt-sglang CPU engine, one MoE layer (2 threads)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    data = [json.loads(Path(f).read_text()) for f in sys.argv[1:]]
    print(table(data))
    print()
    print(kt_kernel_table(data))
    plot(data, DOCS / "benchmarks.png")
    print(f"wrote {DOCS / 'benchmarks.png'}")
