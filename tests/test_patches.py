"""Every diff in patches/ still applies to the installed SGLang (checked on a copy)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import sglang

PATCHES = sorted((Path(__file__).resolve().parents[1] / "patches").glob("*.diff"))
SITE = Path(sglang.__file__).resolve().parents[1]


def test_there_are_patches():
    assert len(PATCHES) >= 2


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_patch_applies_to_installed_sglang(patch, tmp_path):
    text = patch.read_text()
    assert text.splitlines()[0].startswith("kt-sglang patch"), "a patch starts with its header"
    targets = re.findall(r"^\+\+\+ b/(\S+)", text, flags=re.M)
    assert targets, f"{patch.name} changes no file"
    for target in targets:
        (tmp_path / target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(SITE / target, tmp_path / target)
    r = subprocess.run(
        ["git", "apply", "--check", "-p1", str(patch)], cwd=tmp_path, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
