"""The kernel skeletons never branch on a code layout.

A method's decoder names its code layout (native/src/kernels/codes.h), and the layouts' lane
operations live in codes.h and the families' codes-inl.h. Every other kernel file (tiling,
prefetch, chains, epilogue) reads codes only through them, so that a new code width is a new layout,
not an edit to every skeleton.
"""

from __future__ import annotations

import re
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[1] / "native" / "src" / "kernels"
LAYOUT_FILES = {"codes.h", "codes-inl.h"}

# The layouts and the flags the skeletons used to test: never named in a skeleton.
NAMES = re.compile(r"\b(OffsetBytes|IntNibbles|E2m1Nibbles|kNibbles|kLookupNibbles|kE2m1Twice)\b|Codes::k")
# A layout's data (bit width, bias, codebook, ...) is fine as a bound or a shift, never as a branch.
LAYOUT_DATA = re.compile(r"\b(kBits|kBias|kCodebook|kHasCodebook|kSignedValues|kInt8Input|kParts|kDecoded)\b")
BRANCH = re.compile(r"\bif\b|\?")


def layout_branches(root: Path = KERNELS) -> list[str]:
    """Each line of a skeleton under `root` that names a layout or branches on a layout's data."""
    found = []
    for path in sorted(root.rglob("*")):
        if path.suffix not in (".h", ".cpp") or path.name in LAYOUT_FILES:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("//", 1)[0]
            if NAMES.search(code) or (BRANCH.search(code) and LAYOUT_DATA.search(code)):
                found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return found


def test_no_code_layout_branches_in_skeletons():
    assert len(list(KERNELS.rglob("qgemm*-inl.h"))) >= 6, f"no kernel skeletons under {KERNELS}"
    found = layout_branches()
    assert not found, (
        "code-layout branches in kernel skeletons (use the layout's lane operations):\n" + "\n".join(found)
    )


def test_the_check_sees_a_branch(tmp_path):
    (tmp_path / "avx2").mkdir()
    (tmp_path / "avx2" / "qgemm-inl.h").write_text(
        "if constexpr (kNibbles<D>) x();\n"
        "const int s = C::kBits == 4 ? 1 : 0;\n"
        "for (int p = 0; p < kParts<C>; ++p) y(C::kBits * p);  // IntNibbles: 2 parts\n"
    )
    (tmp_path / "avx2" / "codes-inl.h").write_text("if constexpr (C::kBits == 8) x();\n")
    found = layout_branches(tmp_path)
    assert [f.split(":")[:2] for f in found] == [["avx2/qgemm-inl.h", "1"], ["avx2/qgemm-inl.h", "2"]]
