"""Renders docs/architecture.png, the data flow of one MoE layer: python docs/architecture_diagram.py."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

BOXES = {  # name: (x, y, w, h, text, colour)
    "router": (0.5, 6.0, 3.0, 1.0, "router (SGLang)\ntopk_ids, topk_weights [T, k]", "#dddddd"),
    "split": (
        4.5,
        6.0,
        3.4,
        1.0,
        "split per token\nhot → GPU slot | cold now | cold deferred\n(router tensors untouched)",
        "#ffe9a8",
    ),
    "gpu": (
        0.3,
        3.4,
        3.4,
        1.3,
        "GPU: hot experts\nSGLang's method / Triton kernel\nweights in slots (any placement)",
        "#b7e1a1",
    ),
    "pinned": (4.3, 3.9, 2.6, 0.9, "pinned host buffers\n(per captured batch size)", "#cfe2f3"),
    "engine": (
        7.6,
        3.4,
        3.6,
        1.3,
        "CPU engine (C++)\nAMX / AVX-512 / AVX2, NUMA pools\nBF16 / INT8 / INT4 experts",
        "#9fc5e8",
    ),
    "sum": (3.6, 1.3, 3.6, 1.0, "out(L) = hot + cold now + deferred(L_prev)", "#f4cccc"),
    "next": (8.0, 1.3, 3.4, 1.0, "deferred(L) is added to the\nnext MoE layer's output", "#ead1dc"),
}
ARROWS = [
    ("router", "split", ""),
    ("split", "gpu", "hot ids"),
    ("split", "pinned", "hidden, cold ids (D2H)"),
    ("pinned", "engine", "submit"),
    ("gpu", "sum", "fp32"),
    ("engine", "sum", "sync: cold now"),
    ("engine", "next", "deferred task runs\nduring layer L+1"),
]


def centre(name, side):
    x, y, w, h, *_ = BOXES[name]
    return {
        "top": (x + w / 2, y + h),
        "bottom": (x + w / 2, y),
        "left": (x, y + h / 2),
        "right": (x + w, y + h / 2),
    }[side]


def main() -> None:
    fig, ax = plt.subplots(figsize=(11.5, 7.5))
    for x, y, w, h, text, colour in BOXES.values():
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05", fc=colour, ec="#333333"))
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=9)
    for a, b, label in ARROWS:
        (ax_, ay), (bx, by) = BOXES[a][:2], BOXES[b][:2]
        if abs(ay - by) < 0.6:
            start, end = (
                (centre(a, "right"), centre(b, "left"))
                if ax_ < bx
                else (centre(a, "left"), centre(b, "right"))
            )
        else:
            start, end = (centre(a, "bottom"), centre(b, "top"))
        ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=14, color="#333333"))
        if label:
            ax.text(
                (start[0] + end[0]) / 2 + 0.1, (start[1] + end[1]) / 2, label, fontsize=8, color="#1f3d7a"
            )
    ax.set_xlim(0, 11.8)
    ax.set_ylim(0.8, 7.4)
    ax.axis("off")
    ax.set_title("One MoE layer L in kt-sglang (KTEPWrapperMethod → HybridMoELayer)", fontsize=11)
    fig.tight_layout()
    fig.savefig(Path(__file__).with_name("architecture.png"), dpi=110)


if __name__ == "__main__":
    main()
