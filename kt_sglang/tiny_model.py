"""A tiny MoE model generated locally: HF config, per-expert safetensors and a trained tokenizer.

No model hub is needed: the tokenizer is a byte-level BPE trained on a few paragraphs shipped here,
and the weights are HF transformers' own initialization, saved with the per-expert tensor names
that real checkpoints use.

Routing is made decisive, so that bf16 rounding cannot flip a top-k choice (a flip changes the
output by O(1), far beyond rounding): the first E hidden dimensions carry a per-token code (expert
a of the token at strength 1, expert b at 1/2) that no layer writes to, and the router reads only
those dimensions. Every token still goes through attention and its experts as usual.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A mixture of experts routes every token to a few
experts. Hot experts stay on the GPU and cold experts run on the CPU, close to the memory that
holds them. The engine reads weights once per step, so decoding is bound by memory bandwidth.
Large language models answer questions, write code, translate text and summarize documents.
Hello! How are you today? I am fine, thank you. What is the capital of France? Paris is the
capital of France. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Tell me a story about a robot who
learns to paint. Once upon a time there was a small robot in a quiet town by the sea.
"""


@dataclass(frozen=True)
class TinyMoESpec:
    """The shape of a generated model; ``arch`` is ``qwen3_moe`` or ``mixtral``."""

    arch: str = "qwen3_moe"
    num_layers: int = 3
    hidden_size: int = 128
    moe_intermediate_size: int = 64
    num_experts: int = 8
    top_k: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    vocab_size: int = 512
    init_std: float = 0.05
    seed: int = 0


def train_tokenizer(out_dir: Path, vocab_size: int) -> int:
    """Byte-level BPE trained on the embedded corpus (kt_sglang.tokenizer); returns its size."""
    from kt_sglang.tokenizer import train_bpe_tokenizer

    return len(train_bpe_tokenizer(_CORPUS.splitlines(), vocab_size, out_dir))


def _config(spec: TinyMoESpec, vocab: int, eos: int, pad: int):
    common = dict(
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        num_experts_per_tok=spec.top_k,
        max_position_embeddings=1024,
        initializer_range=spec.init_std,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=pad,  # <|endoftext|> is both
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    if spec.arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        # every layer MoE: SGLang's Qwen3-MoE ignores mlp_only_layers (released models have none)
        return Qwen3MoeConfig(
            num_experts=spec.num_experts,
            moe_intermediate_size=spec.moe_intermediate_size,
            intermediate_size=2 * spec.moe_intermediate_size,
            norm_topk_prob=True,
            architectures=["Qwen3MoeForCausalLM"],
            **common,
        )
    if spec.arch == "mixtral":
        from transformers import MixtralConfig

        return MixtralConfig(
            num_local_experts=spec.num_experts,
            intermediate_size=spec.moe_intermediate_size,
            architectures=["MixtralForCausalLM"],
            **common,
        )
    raise ValueError(f"unknown tiny model architecture {spec.arch!r}; expected qwen3_moe or mixtral")


_EXPERT_NAMES = {  # fused v5 parameter -> per-expert checkpoint names (gate, up, down)
    "qwen3_moe": ("mlp.experts", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe.experts", "w1", "w3", "w2"),
}


def per_expert_state_dict(model: torch.nn.Module, arch: str) -> dict[str, torch.Tensor]:
    """The model's tensors with fused experts split into the per-expert names of real checkpoints."""
    prefix, gate, up, down = _EXPERT_NAMES[arch]
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = t.detach().to(torch.bfloat16).contiguous()
        if name.endswith("experts.gate_up_proj"):  # [E, 2I, H]
            base = name[: -len("mlp.experts.gate_up_proj")] + prefix
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}.{e}.{gate}.weight"] = t[e, :half].clone()
                out[f"{base}.{e}.{up}.weight"] = t[e, half:].clone()
        elif name.endswith("experts.down_proj"):  # [E, H, I]
            base = name[: -len("mlp.experts.down_proj")] + prefix
            for e in range(t.shape[0]):
                out[f"{base}.{e}.{down}.weight"] = t[e].clone()
        elif arch == "mixtral" and ".mlp.gate." in name:
            out[name.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = t
        else:
            out[name] = t
    return out


def _decisive_routing(model: torch.nn.Module, num_experts: int, strength: float = 3.0) -> None:
    gen = torch.Generator().manual_seed(1)
    E = num_experts
    with torch.no_grad():
        emb = model.get_input_embeddings().weight  # [V, H]
        V = emb.shape[0]
        a = torch.randint(0, E, (V,), generator=gen)
        b = (a + torch.randint(1, E, (V,), generator=gen)) % E
        emb[:, :E] = 0
        emb[torch.arange(V), a] = strength
        emb[torch.arange(V), b] = 0.8 * strength
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "experts.down_proj", "mlp.down_proj.weight")):
                p[..., :E, :] = 0  # [.., H, in]: no layer writes the routing code
            elif name.endswith(("mlp.gate.weight", "router.weight")) and p.shape[0] == E:
                p.zero_()
                p[:, :E] = torch.eye(E) * 0.6  # a and b weigh about 0.7 / 0.3


def write_tiny_moe(out_dir: str | Path, spec: TinyMoESpec = TinyMoESpec()) -> Path:
    """Writes config.json, model.safetensors and the tokenizer into ``out_dir``; returns it."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = train_tokenizer(out, spec.vocab_size)
    tok = AutoTokenizer.from_pretrained(out)
    config = _config(spec, vocab, tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _decisive_routing(model, spec.num_experts)
    save_file(per_expert_state_dict(model, spec.arch), out / "model.safetensors", metadata={"format": "pt"})
    config.dtype = torch.bfloat16  # what the checkpoint holds and SGLang serves in
    config.save_pretrained(out)
    (out / "generation_config.json").write_text(
        json.dumps(
            {"eos_token_id": config.eos_token_id, "pad_token_id": config.pad_token_id, "do_sample": False}
        )
    )
    return out
