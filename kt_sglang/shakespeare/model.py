"""The Shakespeare MoE: its shape, tokenizer, held-out windows and where the trained weights live."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kt_sglang.tokenizer import BOS

MODEL_DIR = Path(__file__).parent / "model"  # the trained weights, tokenizer and training.json


@dataclass(frozen=True)
class ModelSpec:
    """Shape and training recipe. Sizes are multiples of 128 so that every method's groups divide them."""

    num_layers: int = 4
    hidden_size: int = 256
    moe_intermediate_size: int = 128
    num_experts: int = 16
    top_k: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    vocab_size: int = 4096
    context: int = 256
    router_aux_loss_coef: float = 0.02
    seed: int = 0
    steps: int = 1500
    batch: int = 16
    peak_lr: float = 3e-3


def build_config(spec: ModelSpec, tokenizer):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.top_k,
        moe_intermediate_size=spec.moe_intermediate_size,
        intermediate_size=2 * spec.moe_intermediate_size,
        norm_topk_prob=True,
        router_aux_loss_coef=spec.router_aux_loss_coef,
        max_position_embeddings=1024,
        initializer_range=0.02,
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        architectures=["Qwen3MoeForCausalLM"],
    )


def eval_windows(tokenizer, context: int) -> list[list[int]]:
    """The held-out plays as non-overlapping windows of ``context`` tokens, each starting with BOS.

    The last partial window of each play is dropped, so every window has the same length.
    """
    from kt_sglang.shakespeare.corpus import HELD_OUT_PLAYS, play_text

    bos = tokenizer.convert_tokens_to_ids(BOS)
    windows: list[list[int]] = []
    for play in HELD_OUT_PLAYS:
        ids = tokenizer(play_text(play), add_special_tokens=False)["input_ids"]
        step = context - 1
        windows += [[bos] + ids[i : i + step] for i in range(0, len(ids) - step + 1, step)]
    return windows


def held_out_loss(model, windows: list[list[int]], batch: int = 32) -> float:
    """Mean cross-entropy (nats) of every token after the BOS of each window."""
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(windows), batch):
            ids = torch.tensor(windows[start : start + batch])
            logits = model(ids).logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
            )
            total += loss.item()
            count += ids[:, 1:].numel()
    return total / count


def save_model(model, tokenizer, config, out: Path) -> None:
    """Writes bf16 safetensors with per-expert tensor names (as Qwen3-MoE releases), config, tokenizer."""
    from safetensors.torch import save_file

    from kt_sglang.tiny_model import per_expert_state_dict
    from kt_sglang.weights.canonical_files import file_mode

    weights = out / "model.safetensors"
    save_file(per_expert_state_dict(model, "qwen3_moe"), weights, metadata={"format": "pt"})
    weights.chmod(file_mode())  # safetensors creates it 0600
    config.dtype = torch.bfloat16
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    generation = {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "do_sample": False,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=1) + "\n")
