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


def convert_args(checkpoint: Path, out: Path, quant: str) -> list[str]:
    return [
        "--input-path",
        str(checkpoint),
        "--input-type",
        "bf16",
        "--output",
        str(out),
        "--quant-method",
        quant,
    ]


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


def engine_output(weight_path: Path, method: str) -> torch.Tensor:
    x = make_hidden(20, H)
    ids, wts = make_routing(20, E, K)
    w = KTMoEWrapper(2, E, K, H, I, None, 2, 1, weight_path=str(weight_path), method=method)
    w.load_weights()
    return w.forward(x, ids, wts)


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "per-layer"])
@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_converted_equals_quantize_on_load(tmp_path, checkpoint, quant, merge):
    out = tmp_path / f"cpu-{quant}"
    args = convert_args(checkpoint, out, quant) + ([] if merge else ["--no-merge-safetensor"])
    r = convert(*args)
    assert r.returncode == 0, r.stderr
    files = sorted(p.name for p in out.iterdir())
    if merge:
        assert files == [
            "experts-00001-of-00001.safetensors",
            "kt_weights.json",
            "model.safetensors.index.json",
        ]
    else:
        assert files == ["kt_weights.json", "layer-00001.safetensors", "layer-00002.safetensors"]
    method = {"int4": "AMXINT4", "int8": "AMXINT8"}[quant]
    assert torch.equal(engine_output(checkpoint, method), engine_output(out, method))


def test_merge_into_several_shards_and_resume_an_interrupted_merge(tmp_path, checkpoint):
    """Shards of whole layers with an index; the per-layer files go only once the index exists, so
    a merge cut short is merged again, byte-identical."""
    from kt_sglang.weights.canonical_files import Manifest, merge_layers, read_index

    per_layer = tmp_path / "per-layer"
    assert convert(*convert_args(checkpoint, per_layer, "int4"), "--no-merge-safetensor").returncode == 0
    manifest = Manifest.read(per_layer)
    one_layer = (per_layer / "layer-00001.safetensors").stat().st_size
    merged = tmp_path / "merged"
    shutil.copytree(per_layer, merged)
    shards = merge_layers(merged, manifest, shard_bytes=one_layer)  # one layer per shard
    assert [p.name for p in shards] == [
        "experts-00001-of-00002.safetensors",
        "experts-00002-of-00002.safetensors",
    ]
    index = read_index(merged)
    assert index["layers.1.experts.0.gate.weight"] == shards[0].name
    assert index["layers.2.experts.7.down.scales"] == shards[1].name
    assert not list(merged.glob("layer-*"))
    assert torch.equal(engine_output(per_layer, "AMXINT4"), engine_output(merged, "AMXINT4"))
    # Cut short after the first shard: no index yet, the per-layer files are all still there.
    cut = tmp_path / "cut"
    shutil.copytree(per_layer, cut)
    shutil.copy(shards[0], cut / shards[0].name)
    merge_layers(cut, manifest, shard_bytes=one_layer)
    assert digest(cut) == digest(merged)


def test_rerun_and_interrupted_run_are_byte_identical(tmp_path, checkpoint):
    args = ["--input-path", str(checkpoint), "--input-type", "bf16", "--quant-method", "int4"]
    merged = tmp_path / "merged"
    assert convert(*args, "--output", str(merged)).returncode == 0
    before = digest(merged)
    r = convert(*args, "--output", str(merged))  # a merged output is complete: nothing to do
    assert r.returncode == 0 and "0 layers converted, 2 already complete" in r.stdout
    assert digest(merged) == before
    args.append("--no-merge-safetensor")
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


def test_canonical_dir_with_physical_map(tmp_path, checkpoint):
    out = tmp_path / "cpu"
    assert convert(*convert_args(checkpoint, out, "int8")).returncode == 0
    slots = [5, 5, 0, 7]
    x = make_hidden(12, H)
    ids, wts = make_routing(12, 4, K)
    outputs = []
    for path in (checkpoint, out):
        w = KTMoEWrapper(1, 4, K, H, I, None, 2, 1, weight_path=str(path), method="AMXINT8")
        w.load_weights(slots)
        outputs.append(w.forward(x, ids, wts))
    assert torch.equal(outputs[0], outputs[1])


def _rss_anon_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return 0


def test_killed_mid_run_then_rerun_is_identical_and_memory_streams(tmp_path):
    """A multi-layer model: kill the converter after its first layer, rerun, compare; peak memory
    (anonymous RSS, polled) stays near one layer's experts, not the model's."""
    import time

    n_layers, e, i, h = 6, 16, 256, 1024
    tensors = {}
    for layer in range(1, n_layers + 1):
        tensors.update(per_expert(QWEN, layer, make_weights(e, i, h, seed=layer)))
    cfg = qwen_config(num_experts=e, moe_intermediate_size=i, hidden_size=h, num_hidden_layers=n_layers + 1)
    ckpt = write_checkpoint(tmp_path / "big", cfg, tensors)
    layer_bytes = 3 * e * i * h * 2
    exe = shutil.which("kt-sglang", path=os.path.dirname(sys.executable))
    base = [
        exe,
        "convert-cpu",
        "--input-path",
        str(ckpt),
        "--input-type",
        "bf16",
        "--quant-method",
        "int4",
        "--cpuinfer-threads",
        "1",
        "--no-merge-safetensor",  # measures the streaming conversion; the merge holds one shard
    ]
    whole = tmp_path / "whole"
    proc = subprocess.Popen([*base, "--output", str(whole)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    samples = []
    while proc.poll() is None:
        samples.append(_rss_anon_kib(proc.pid) * 1024)
        time.sleep(0.01)
    assert proc.returncode == 0
    probe = (
        "import kt_sglang.weights.convert_cpu, re;"
        "print(re.search(r'RssAnon:\\s+(\\d+)', open('/proc/self/status').read()).group(1))"
    )
    idle = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    baseline = int(idle.stdout.strip()) * 1024  # the converter's imports, before any weights
    # Measured ~1.6 layers (a layer in flight, its output, allocator slack); the model is 6 layers.
    assert max(samples) - baseline < 2 * layer_bytes, (max(samples), baseline, layer_bytes)

    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        [*base, "--output", str(killed)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    while proc.poll() is None and not (killed / "layer-00001.safetensors").exists():
        time.sleep(0.005)
    proc.kill()
    proc.wait()
    assert len(list(killed.glob("layer-*.safetensors"))) < n_layers  # it really stopped early
    r = subprocess.run([*base, "--output", str(killed)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0
    assert {k: v for k, v in digest(killed).items() if not k.endswith(".tmp")} == digest(whole)


def test_disk_full_leaves_nothing_partial(tmp_path, checkpoint, monkeypatch):
    """A write that fails (disk full) is a clear error, and no file with a final name appears."""
    import errno

    import kt_sglang.weights.canonical_files as files
    from kt_sglang.weights.convert_cpu import build_parser, main

    real_save = files.save_file
    calls = []

    def save_then_fail(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:  # the second layer: write half a file, then run out of space
            Path(path).write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(files, "save_file", save_then_fail)
    out = tmp_path / "full"
    argv = convert_args(checkpoint, out, "int4") + ["--no-merge-safetensor"]
    assert build_parser().parse_args(argv).output == str(out)
    assert main(argv) == 2
    assert sorted(p.name for p in out.iterdir()) == ["kt_weights.json", "layer-00001.safetensors"]
    monkeypatch.setattr(files, "save_file", real_save)
    assert main(argv) == 0  # resumes: only the missing layer is written
    assert sorted(p.name for p in out.iterdir())[-1] == "layer-00002.safetensors"


def test_broken_manifest_names_the_file(tmp_path, checkpoint):
    """A manifest that is not JSON, not an object, or lacks a field: one ValueError naming the file."""
    import json

    out = tmp_path / "out"
    assert convert(*convert_args(checkpoint, out, "int8")).returncode == 0
    manifest = out / "kt_weights.json"
    good = json.loads(manifest.read_text())
    without_method = {k: v for k, v in good.items() if k != "method"}
    for text, message in (
        ('{"format": "kt-sglang-experts", "vers', "is not valid JSON"),
        ("[1, 2]", "holds list, not a manifest object"),
        (json.dumps(without_method), "lacks method: convert again"),
        (json.dumps({**good, "colour": "red"}), "has unknown colour: convert again"),
    ):
        manifest.write_text(text)
        with pytest.raises(ValueError, match=f"kt_weights.json {message}") as info:
            engine_output(out, "AMXINT8")
        assert str(manifest) in str(info.value)


def test_output_that_is_in_or_holds_a_model_is_refused(tmp_path, checkpoint):
    """Merging into a model directory replaced its index: SGLang then loaded none of its weights."""
    other = write_checkpoint(tmp_path / "other", qwen_config(), {})
    for output, problem in (
        (checkpoint, "is the input checkpoint"),
        (checkpoint / "cpu", "is inside the input checkpoint"),
        (tmp_path, "contains the input checkpoint"),
        (other, "holds a model"),
        (other / "cpu", "is inside the model directory"),
    ):
        r = convert(*convert_args(checkpoint, output, "int8"))
        assert r.returncode == 2, (output, r.stderr)
        assert f"--output {output} {problem}" in r.stderr and "Traceback" not in r.stderr
    assert not (checkpoint / "kt_weights.json").exists() and not (checkpoint / "cpu").exists()
    # A model directory that got our index anyway is refused by the loader, naming the index.
    out = tmp_path / "cpu"
    assert convert(*convert_args(checkpoint, out, "int8")).returncode == 0
    shutil.copy(out / "model.safetensors.index.json", checkpoint)
    with pytest.raises(CheckpointError, match="was written by kt-sglang convert-cpu"):
        KTMoEWrapper(1, E, K, H, I, None, 2, 1, weight_path=str(checkpoint), method="AMXINT8").load_weights()


def test_rerun_after_a_kill_past_the_index_removes_the_leftovers(tmp_path, checkpoint):
    merged, per_layer = tmp_path / "merged", tmp_path / "per-layer"
    assert convert(*convert_args(checkpoint, merged, "int4")).returncode == 0
    expected = digest(merged)
    assert convert(*convert_args(checkpoint, per_layer, "int4"), "--no-merge-safetensor").returncode == 0
    for layer_file in per_layer.glob("layer-*.safetensors"):  # killed after the index, before the unlinks
        shutil.copy(layer_file, merged)
    (merged / "experts-00001-of-00001.safetensors.tmp").write_bytes(b"\0" * 2**20)
    (merged / ".tmp9VtrPw").write_bytes(b"\0" * 2**20)  # safetensors' own, killed inside save_file
    r = convert(*convert_args(checkpoint, merged, "int4"))
    assert r.returncode == 0 and "0 layers converted, 2 already complete" in r.stdout, r.stderr
    assert "removed layer-00001.safetensors, left by an interrupted run" in r.stdout
    assert "removed .tmp9VtrPw" in r.stdout
    assert digest(merged) == expected


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_files_follow_the_umask(tmp_path, checkpoint, umask):
    for merge in ([], ["--no-merge-safetensor"]):
        out = tmp_path / f"out{len(merge)}"
        old = os.umask(umask)
        try:
            assert convert(*convert_args(checkpoint, out, "int8"), *merge).returncode == 0
        finally:
            os.umask(old)
        modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
        assert set(modes.values()) == {oct(0o666 & ~umask)}, modes


@pytest.mark.parametrize("threads", ["0", "-1", "100000"])
def test_thread_count_has_one_rule(tmp_path, checkpoint, threads):
    from kt_sglang.engine.pools import physical_cores

    r = convert(*convert_args(checkpoint, tmp_path / "o", "int8"), "--cpuinfer-threads", threads)
    cores = physical_cores()
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"error: --cpuinfer-threads {threads}: this machine has {cores} physical cores; use 1..{cores} "
        "(threads beyond the cores only contend)"
    ]
    assert not (tmp_path / "o").exists()


def _message(capsys) -> str:
    """The one line the converter printed besides its progress bar."""
    lines = [ln.rsplit("\r", 1)[-1] for ln in capsys.readouterr().err.splitlines()]
    lines = [ln for ln in lines if ln.strip() and not ln.startswith("convert-cpu:")]
    assert len(lines) == 1, lines
    return lines[0]


def test_io_errors_and_interrupts_are_one_line(tmp_path, checkpoint, monkeypatch, capsys):
    """safetensors' own error type (what a full disk raises), the free-space check before starting,
    and Ctrl-C: one line each, naming the path and the bytes, and a rerun resumes."""
    from collections import namedtuple

    from safetensors import SafetensorError

    import kt_sglang.weights.canonical_files as files
    import kt_sglang.weights.convert_cpu as converter

    real_save = files.save_file

    def failing_save(tensors, path, metadata=None):
        Path(path).write_bytes(b"partial")
        raise SafetensorError("Error while serializing: IoError(No space left on device)")

    out = tmp_path / "out"
    argv = convert_args(checkpoint, out, "int4")
    monkeypatch.setattr(files, "save_file", failing_save)
    assert converter.main(argv) == 2
    err = _message(capsys)
    assert str(out / "layer-00001.safetensors") in err
    assert "No space left on device" in err and "MiB are free; rerun to resume" in err
    assert sorted(p.name for p in out.iterdir()) == ["kt_weights.json"]

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(files, "save_file", real_save)
    monkeypatch.setattr(converter.shutil, "disk_usage", lambda path: usage(2**30, 2**30 - 1000, 1000))
    assert converter.main(argv) == 2
    assert _message(capsys).startswith(f"error: {out} has 0.0 MiB free; converting needs ")
    monkeypatch.undo()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(converter, "write_layer", interrupted)
    assert converter.main(argv) == 130
    assert (
        _message(capsys)
        == "interrupted: the layers written so far are kept; rerun the same command to resume"
    )
    monkeypatch.undo()
    assert converter.main(argv) == 0


@pytest.mark.parametrize("damage", ["truncated", "zero-byte", "garbage header"])
def test_damaged_converted_file_is_named_at_load(tmp_path, checkpoint, damage):
    out = tmp_path / "cpu"
    assert convert(*convert_args(checkpoint, out, "int8"), "--no-merge-safetensor").returncode == 0
    layer = out / "layer-00001.safetensors"
    data = layer.read_bytes()
    layer.write_bytes(
        {"truncated": data[: len(data) // 2], "zero-byte": b"", "garbage header": b"\xff" * 64 + data[64:]}[
            damage
        ]
    )
    w = KTMoEWrapper(1, E, K, H, I, None, 2, 1, weight_path=str(out), method="AMXINT8")
    with pytest.raises(ValueError, match="cannot read .*layer-00001.safetensors .*convert again"):
        w.load_weights()


def test_converted_group_is_read_from_the_directory(tmp_path, checkpoint):
    """A directory converted at a non-default group loads without naming the group again (the plugin
    has no group flag), and equals that group quantized on load."""
    out = tmp_path / "g32"
    assert convert(*convert_args(checkpoint, out, "int8"), "--group-size", "32").returncode == 0
    w = KTMoEWrapper(2, E, K, H, I, None, 2, 1, weight_path=str(out), method="AMXINT8")
    assert w.group_size == 32
    w.load_weights()
    x = make_hidden(20, H)
    ids, wts = make_routing(20, E, K)
    on_load = KTMoEWrapper(
        2, E, K, H, I, None, 2, 1, weight_path=str(checkpoint), method="AMXINT8", group_size=32
    )
    on_load.load_weights()
    assert torch.equal(w.forward(x, ids, wts), on_load.forward(x, ids, wts))
