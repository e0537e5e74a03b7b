"""kt-sglang convert-cpu: canonical files that load exactly like quantizing on load, and resume."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_hidden, make_routing, make_weights
from test_weights_checkpoint import QWEN, per_expert, qwen_config, write_checkpoint

from kt_sglang import KTMoEWrapper
from kt_sglang.weights.checkpoint import CheckpointError

E, K, H, I = 8, 2, 256, 128


def convert(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("kt-sglang", path=os.path.dirname(sys.executable))
    return subprocess.run([exe, "convert-cpu", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    tensors = {}
    for layer in (1, 2):
        tensors.update(per_expert(QWEN, layer, make_weights(E, I, H, seed=20 + layer)))
    return write_checkpoint(tmp_path / "qwen", qwen_config(), tensors)


def digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_converted_equals_quantize_on_load(tmp_path, checkpoint, quant):
    out = tmp_path / f"cpu-{quant}"
    r = convert(
        "--input-path", str(checkpoint), "--input-type", "bf16", "--output", str(out), "--quant-method", quant
    )
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "kt_weights.json",
        "layer-00001.safetensors",
        "layer-00002.safetensors",
    ]
    method = {"int4": "AMXINT4", "int8": "AMXINT8"}[quant]
    x = make_hidden(20, H)
    ids, wts = make_routing(20, E, K)
    outputs = []
    for path in (checkpoint, out):
        w = KTMoEWrapper(2, E, K, H, I, None, 2, 1, weight_path=str(path), method=method)
        w.load_weights()
        outputs.append(w.forward(x, ids, wts))
    assert torch.equal(outputs[0], outputs[1])


def test_rerun_and_interrupted_run_are_byte_identical(tmp_path, checkpoint):
    args = ["--input-path", str(checkpoint), "--input-type", "bf16", "--quant-method", "int4"]
    whole = tmp_path / "whole"
    assert convert(*args, "--output", str(whole)).returncode == 0
    expected = digest(whole)
    r = convert(*args, "--output", str(whole))
    assert r.returncode == 0 and "0 layers converted, 2 already complete" in r.stdout
    assert digest(whole) == expected
    # An interrupted run: the last layer never renamed into place, a temporary file left behind.
    part = tmp_path / "part"
    shutil.copytree(whole, part)
    (part / "layer-00002.safetensors").rename(part / "layer-00002.safetensors.tmp")
    (part / "layer-00002.safetensors.tmp").write_bytes(b"half a file")
    r = convert(*args, "--output", str(part))
    assert r.returncode == 0 and "1 layers converted, 1 already complete" in r.stdout
    assert {k: v for k, v in digest(part).items() if not k.endswith(".tmp")} == expected
    # --resume-layer skips earlier layers without touching them.
    r = convert(*args, "--output", str(part), "--resume-layer", "2")
    assert r.returncode == 0 and "0 layers converted, 1 already complete" in r.stdout


def test_converter_errors(tmp_path, checkpoint):
    base = ["--input-path", str(checkpoint), "--output", str(tmp_path / "o")]
    r = convert(*base, "--input-type", "fp8", "--quant-method", "int4")
    assert (
        r.returncode == 2
        and "--input-type fp8 does not match the checkpoint: its experts are bf16" in r.stderr
    )
    assert not (tmp_path / "o").exists()
    r = convert(*base, "--input-type", "bf16", "--quant-method", "int4", "--resume-layer", "9")
    assert r.returncode == 2 and "--resume-layer 9 is past the last MoE layer (2)" in r.stderr
    assert convert(*base, "--input-type", "bf16", "--quant-method", "int4").returncode == 0
    r = convert(*base, "--input-type", "bf16", "--quant-method", "int8")
    assert r.returncode == 2 and "holds a conversion of another model or method" in r.stderr
    w = KTMoEWrapper(1, E, K, H, I, None, 2, 1, weight_path=str(tmp_path / "o"), method="AMXINT8")
    with pytest.raises(
        CheckpointError, match="converted for AMXINT4 group 64; this layer uses AMXINT8 group 64"
    ):
        w.load_weights()
    r = convert(
        "--input-path",
        str(tmp_path / "missing"),
        "--output",
        str(tmp_path / "x"),
        "--input-type",
        "bf16",
        "--quant-method",
        "int8",
    )
    assert r.returncode == 2 and "config.json does not exist" in r.stderr
