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


BANDWIDTH_NOTE = (
    "Decode: bytes of the distinct experts' packed weights a call reads / its time, over the read bandwidth "
    "of the same threads streaming 0.5 GiB,\nprobed between the point's own calls. Above 100%: the host's "
    "bandwidth was higher during the calls than during the probes, or part of the weights came from the L3."
)


def plot(results: list[dict], out: Path) -> None:
    """Decode bandwidth fraction and prefill tokens/s of every row at each run's highest thread count.

    Colour is the method and line style the layer; the legend sits below both panels, where it hides no
    line, above a note on what the bandwidth fraction divides by.
    """
    rows = [
        r for res in results for r in res["rows"] if r["threads"] == max(int(t) for t in res["bandwidth_gbs"])
    ]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 5.6))
    top, ticks = 130.0, (set(), set())
    for r in rows:
        i, j = methods.index(r["method"]), layers.index(r["layer"])
        style = dict(color=f"C{i % 10}", linestyle=("-", "--", ":", "-.")[j % 4], marker="os^D"[j % 4])
        style["label"] = f"{r['layer']} {r['method']}"
        d = sorted((int(t), v["bw_fraction"] * 100) for t, v in r["decode"].items())
        p = sorted((int(t), v["tokens_per_s"]) for t, v in r["prefill"].items())
        for ax, points, seen in ((axes[0], d, ticks[0]), (axes[1], p, ticks[1])):
            if points:
                ax.plot(*zip(*points, strict=True), **style)
                seen.update(t for t, _ in points)
        top = max(top, *(v + 10 for _, v in d))
    axes[0].set(xscale="log", xlabel="decode tokens", ylabel="effective read bandwidth, % of the probe")
    axes[0].set_ylim(0, top)
    for y, text, line in ((100, "100% =\nprobe", ":"), (80, "80%\ntarget", "--")):
        axes[0].axhline(y, color="gray", linestyle=line, linewidth=1)
        axes[0].annotate(
            text, (1.01, y), xycoords=("axes fraction", "data"), ha="left", va="center", fontsize=7
        )
    axes[1].set(xscale="log", yscale="log", xlabel="prefill tokens", ylabel="tokens / s")
    for ax, seen in zip(axes, ticks, strict=True):
        ax.set_xticks(sorted(seen))
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(True, alpha=0.3)
    handles = {h.get_label(): h for ax in axes for h in ax.get_lines() if not h.get_label().startswith("_")}
    legend_rows = -(-len(handles) // 4)
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.text(0.5, 0.035 * legend_rows + 0.03, BANDWIDTH_NOTE, ha="center", fontsize=7.5, style="italic")
    machine = results[0]["machine"] if results else {}
    threads = max((r["threads"] for r in rows), default=0)
    fig.suptitle(
        f"kt-sglang CPU engine, one MoE layer ({machine.get('cpu', '?')}, {machine.get('isa', '?')} kernels, "
        f"{threads} threads)"
    )
    fig.tight_layout(rect=(0, 0.035 * legend_rows + 0.1, 1, 1))
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    data = [json.loads(Path(f).read_text()) for f in sys.argv[1:]]
    print(table(data))
    print()
    print(kt_kernel_table(data))
    plot(data, DOCS / "benchmarks.png")
    print(f"wrote {DOCS / 'benchmarks.png'}")
