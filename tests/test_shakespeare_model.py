"""The project's trained Shakespeare MoE: it loads in transformers and still reaches its recorded
held-out loss; its routing is not collapsed; its tokenizer starts every sequence with BOS."""

from __future__ import annotations

import json

import pytest
import torch

from kt_sglang.shakespeare.corpus import HELD_OUT_PLAYS, play_names, play_text, training_plays
from kt_sglang.shakespeare.model import BOS, MODEL_DIR, ModelSpec, eval_windows, held_out_loss

RECORD = json.loads((MODEL_DIR / "training.json").read_text())


def test_held_out_plays_are_whole_plays_never_trained_on():
    assert set(HELD_OUT_PLAYS) <= set(play_names())
    assert not set(HELD_OUT_PLAYS) & set(training_plays())
    assert len(training_plays()) + len(HELD_OUT_PLAYS) == len(play_names()) >= 37
    text = play_text("macbeth")
    assert "MACBETH:\n" in text and "**" not in text  # speakers as `NAME:` lines, no Markdown


@pytest.fixture(scope="module")
def model_and_tokenizer():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(MODEL_DIR)


def test_reaches_its_recorded_held_out_loss(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    windows = eval_windows(tokenizer, ModelSpec.context)
    assert len(windows) == RECORD["held_out_windows"]
    loss = held_out_loss(model, windows)
    assert abs(loss - RECORD["held_out_loss"]) < 2e-3, (loss, RECORD["held_out_loss"])
    assert loss < 4.5  # a trained model: uniform over the vocabulary would be ln(4096) = 8.3


def test_routing_is_not_collapsed():
    """Routing is uneven, as in real models, but not collapsed onto a few experts."""
    spec = ModelSpec()
    for layer, load in enumerate(RECORD["expert_load"]):
        assert len(load) == spec.num_experts and abs(sum(load) - 1) < 1e-6
        assert max(load) < 0.25, (layer, load)
        assert sum(share >= 0.01 for share in load) >= 12, (layer, load)


def test_tokenizer_starts_with_bos(model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    bos = tokenizer.convert_tokens_to_ids(BOS)
    assert tokenizer("")["input_ids"] == [bos]
    ids = tokenizer("ROMEO:\nBut, soft!")["input_ids"]
    assert ids[0] == bos and tokenizer.decode(ids[1:]) == "ROMEO:\nBut, soft!"


@pytest.mark.slow
def test_training_is_deterministic(tmp_path):
    """Two short runs of the training script write the same weights and tokenizer."""
    import subprocess
    import sys

    outs = []
    for run in ("a", "b"):
        out = tmp_path / run
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "kt_sglang.shakespeare.train",
                "--out",
                str(out),
                "--steps",
                "3",
                "--batch",
                "2",
            ],
            capture_output=True,
            text=True,
            timeout=900,
            cwd=tmp_path,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        outs.append(out)
    for name in ("model.safetensors", "tokenizer.json"):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name
    record = json.loads((outs[0] / "training.json").read_text())
    assert record["steps"] == 3 and record["held_out_loss"] > RECORD["held_out_loss"]  # barely trained
