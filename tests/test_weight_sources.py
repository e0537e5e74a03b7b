"""`open_source`: every registered source claims its own paths and no other's, a source that
supersedes another takes a path both claim, a path none or two others claim is refused naming what
was looked for, a new source is one registered class, and the layer's configuration opens no file."""

from __future__ import annotations

from pathlib import Path

import pytest

from kt_sglang.engine import MoEConfig
from kt_sglang.engine import weight_source as ws
from kt_sglang.engine.weight_source import ModelShape, WeightSource, WeightSourceError, open_source
from kt_sglang.weights.sources.converted import ConvertedDirectory
from kt_sglang.weights.sources.gguf import GgufSource
from kt_sglang.weights.sources.hf_checkpoint import HfCheckpoint
from kt_sglang.weights.sources.kt_kernel import KtKernelDirectory


def _markers(tmp_path: Path) -> dict[type[WeightSource], Path]:
    """A path carrying each source's markers (claims read names and markers only)."""
    hf, converted, gguf_dir, kt_kernel = (tmp_path / name for name in ("hf", "converted", "gguf", "kt"))
    for d in (hf, converted, gguf_dir):
        d.mkdir()
    (hf / "config.json").write_text("{}")
    (converted / "kt_weights.json").write_text("{}")
    (gguf_dir / "model-00001-of-00002.gguf").write_bytes(b"GGUF")
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    (kt_kernel / "_layer_0" / "_numa_0").mkdir(parents=True)
    return {
        HfCheckpoint: hf,
        ConvertedDirectory: converted,
        GgufSource: gguf_dir,
        KtKernelDirectory: kt_kernel,
    }


def test_each_source_claims_its_own_paths_only(tmp_path):
    paths = _markers(tmp_path)
    assert set(paths) <= set(ws._SOURCES)
    for source, path in paths.items():
        assert [s for s in ws._SOURCES if s.claims(path)] == [source]
        assert type(open_source(path)) is source and open_source(str(path)).path == path
    assert type(open_source(tmp_path / "model.gguf")) is GgufSource


def test_a_path_no_source_or_two_claim_is_refused(tmp_path):
    with pytest.raises(WeightSourceError, match="nowhere does not exist"):
        open_source(tmp_path / "nowhere")
    (tmp_path / "file.bin").write_bytes(b"x")
    with pytest.raises(WeightSourceError, match=r"file\.bin is not a directory, nor a file kt-sglang reads"):
        open_source(tmp_path / "file.bin")
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightSourceError, match=r"holds none of the weights kt-sglang reads .*config\.json"):
        open_source(tmp_path / "empty")
    both = _markers(tmp_path)[GgufSource]
    (both / "kt_weights.json").write_text("{}")
    with pytest.raises(WeightSourceError, match=r"holds more than one kind of weights .*kt_weights\.json"):
        open_source(both)


def test_a_specific_source_takes_a_path_it_shares_with_the_model(tmp_path):
    """A converted, GGUF or kt-kernel directory may carry the model's config.json: the source that
    supersedes the Hugging Face checkpoint's claim reads it."""
    for source, path in _markers(tmp_path).items():
        (path / "config.json").write_text("{}")
        assert HfCheckpoint.claims(path) and type(open_source(path)) is source


def test_a_new_source_is_one_registered_class(tmp_path, monkeypatch):
    monkeypatch.setattr(ws, "_SOURCES", list(ws._SOURCES))

    @ws.register_source
    class Marked(WeightSource):
        describes = "directories marked for this test (MARK)"

        @classmethod
        def claims(cls, path: Path) -> bool:
            return (path / "MARK").is_file()

        def shape(self) -> ModelShape:
            return ModelShape(8, 64, 32, (1,), str(self.path / "MARK"))

        def verify(self, method: str, model: ModelShape) -> None:
            pass

        def load(self, layer, physical_to_logical_map) -> None:
            pass

    (tmp_path / "MARK").write_text("")
    assert type(open_source(tmp_path)) is Marked
    with pytest.raises(ValueError, match="Marked is registered as a weight source twice"):
        ws.register_source(Marked)
    with pytest.raises(WeightSourceError, match=r"LLAMAFILE reads GGUF models .*and this is none"):
        open_source(tmp_path).check_method("LLAMAFILE", "--kt-method")


def test_the_configuration_opens_no_file(tmp_path):
    """A method that takes each layer's from the file leaves the methods to the layer's source."""
    config = MoEConfig(
        1, 8, 2, 64, 32, None, 1, 1, weight_path=str(tmp_path / "nowhere.gguf"), method="llamafile"
    )
    assert (config.file_method, config.method) == ("LLAMAFILE", None)
