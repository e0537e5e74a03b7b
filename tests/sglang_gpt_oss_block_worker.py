"""Builds SGLang's gpt-oss MoE block (`GptOssSparseMoeBlock`, MXFP4 experts) in this process with the
plugin loaded and compares it with HF transformers' `GptOssMLP` on the same weights; prints one JSON
line.

The block's router (bf16, with bias), its TopK (softmax over the top-k logits) and its FusedMoE with
SGLang's `Mxfp4MoEMethod` are SGLang's; its experts are our wrapper, the cold ones on the CPU engine
with `--kt-method MXFP4` reading the checkpoint as it ships. The weights go through SGLang's own
gpt-oss MXFP4 loader (`GptOssForCausalLM._load_mxfp4_experts_weights`: every expert of a tensor in
one FusedMoE.weight_loader call) and our hooks. With `--hot N` the worker loads and reports the GPU
slots only (see the test's docstring). Run by tests/test_sglang_gpt_oss_block.py in a subprocess.

usage: sglang_gpt_oss_block_worker.py WORKDIR --hot 0 --placement uniform --port 29655
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from sglang_moe_block_worker import load_plugin, start_sglang

PREFIX = "model.layers.0.mlp."
E, K, H, I = 16, 4, 256, 192
LIMIT = 7.0
T = 32  # tokens compared
MARGIN = 0.05  # least gap between a token's k-th and (k+1)-th router logit (std ~2): see main()

# FusedMoE's parameter -> the checkpoint tensor of all experts it takes (blocks [E, n, k/32, 16] as
# [E, n, k/2] bytes)
CHECKPOINT_NAME = {
    "w13_weight": "experts.gate_up_proj_blocks",
    "w13_weight_scale": "experts.gate_up_proj_scales",
    "w13_weight_bias": "experts.gate_up_proj_bias",
    "w2_weight": "experts.down_proj_blocks",
    "w2_weight_scale": "experts.down_proj_scales",
    "w2_weight_bias": "experts.down_proj_bias",
}


def as_loaded(w: torch.Tensor) -> torch.Tensor:
    """One expert's checkpoint tensor as FusedMoE holds it: MXFP4 blocks [n, k/32, 16] as [n, k/2]."""
    return w.flatten(1) if w.dim() > 1 else w


def reference_config():
    from transformers import GptOssConfig

    return GptOssConfig(
        architectures=["GptOssForCausalLM"],
        vocab_size=512,
        hidden_size=H,
        intermediate_size=I,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_local_experts=E,
        num_experts_per_tok=K,
        swiglu_limit=LIMIT,
        layer_types=["full_attention"],
        quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]},
        dtype="bfloat16",
    )


def pack_mxfp4(gen: torch.Generator, n: int, k: int, centre: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e2m1 codes for E matrices [n, k] as gpt-oss ships them: blocks [E, n, k/32, 16] (two
    codes a byte, the even element in the low nibble), e8m0 scales [E, n, k/32] about 2^(centre - 127)."""
    codes = torch.randint(0, 16, (E, n, k), generator=gen, dtype=torch.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).reshape(E, n, k // 32, 16)
    scales = (torch.randint(-1, 2, (E, n, k // 32), generator=gen) + centre).to(torch.uint8)
    return blocks, scales


def write_checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    """Layer 0's MoE block in gpt-oss's checkpoint layout: a bf16 router with bias; MXFP4 experts,
    gate and up rows interleaved, with bf16 biases."""
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "router.weight": (torch.randn(E, H, generator=gen) * 0.1).bfloat16(),
        "router.bias": torch.randn(E, generator=gen).bfloat16(),
    }
    # Scales near 2^-4 (gate_up) give gate outputs of several units: the clamp at 7 is reached.
    for proj, n, k, centre in (("gate_up", 2 * I, H, 123), ("down", H, I, 122)):
        blocks, scales = pack_mxfp4(gen, n, k, centre)
        tensors[f"experts.{proj}_proj_blocks"] = blocks
        tensors[f"experts.{proj}_proj_scales"] = scales
        tensors[f"experts.{proj}_proj_bias"] = (torch.randn(E, n, generator=gen) * 0.5).bfloat16()
    tensors = {PREFIX + k: v.contiguous() for k, v in tensors.items()}
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "model.safetensors")
    reference_config().save_pretrained(directory)
    return tensors


def reference_block(tensors: dict[str, torch.Tensor], biases: bool = True) -> torch.nn.Module:
    """HF's float32 `GptOssMLP` on the checkpoint's weights, dequantized by transformers' own MXFP4
    reader (`convert_moe_packed_tensors`)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    t = {k[len(PREFIX) :]: v for k, v in tensors.items()}
    block = GptOssMLP(reference_config()).float()
    state = {name: t[name].float() for name in ("router.weight", "router.bias")}
    for proj in ("gate_up", "down"):
        state[f"experts.{proj}_proj"] = convert_moe_packed_tensors(
            t[f"experts.{proj}_proj_blocks"], t[f"experts.{proj}_proj_scales"], dtype=torch.float32
        )
        bias = t[f"experts.{proj}_proj_bias"].float()
        state[f"experts.{proj}_proj_bias"] = bias if biases else torch.zeros_like(bias)
    block.load_state_dict(state)
    return block


def plain_silu(gate_up: torch.Tensor) -> torch.Tensor:
    """The activation of most MoE models, on gpt-oss's interleaved rows: silu(gate) * up."""
    return torch.nn.functional.silu(gate_up[..., ::2]) * gate_up[..., 1::2]


def halves_swiglu(experts):
    """gpt-oss's activation reading gate and up as the two halves of the rows (not interleaved)."""

    def apply(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return type(experts)._apply_gate(experts, torch.stack([gate, up], -1).flatten(-2))

    return apply


class _Holder(torch.nn.Module):
    """Just enough of `GptOssForCausalLM` for its own MXFP4 expert loader: `config` and the block at
    its checkpoint name."""

    def __init__(self, config, block: torch.nn.Module) -> None:
        super().__init__()
        self.config = config
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.model.layers[0].mlp = block


def load_expert_weights(block: torch.nn.Module, config, tensors: dict[str, torch.Tensor]) -> None:
    """SGLang's gpt-oss MXFP4 expert loader (each tensor holds every expert; FusedMoE.weight_loader with
    expert_id None, where our hook keeps the hot experts' rows) and the router's weight_loader."""
    from sglang.srt.models.gpt_oss import GptOssForCausalLM

    experts = [(n, w) for n, w in tensors.items() if ".experts." in n]
    loaded = GptOssForCausalLM._load_mxfp4_experts_weights(_Holder(config, block), iter(experts))
    assert len(loaded) == 6, loaded
    params = dict(block.named_parameters())
    for name in ("router.weight", "router.bias"):
        target = params[name]
        getattr(target, "weight_loader", lambda p, v: p.data.copy_(v))(target, tensors[PREFIX + name])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--hot", type=int, default=0)
    parser.add_argument("--placement", default="uniform")
    parser.add_argument("--port", type=int, default=29655)
    args = parser.parse_args()

    model_dir = args.workdir / "gpt-oss-block"
    tensors = write_checkpoint(model_dir)
    load_plugin(model_dir, "MXFP4", args.hot, args.placement)

    # SGLang registers its MXFP4 config where is_cuda() or is_cpu() (SGLANG_USE_CPU_ENGINE=1, which
    # needs sgl_kernel's CPU build); --device cpu on a host without either lacks the entry, and
    # ModelConfig would refuse the checkpoint's quant_method. Add the entry a CUDA host has.
    from sglang.srt.layers import quantization
    from sglang.srt.layers.quantization.mxfp4 import Mxfp4Config

    quantization.QUANTIZATION_METHODS.setdefault("mxfp4", Mxfp4Config)
    start_sglang(model_dir, "MXFP4", args.hot, args.port)

    from sglang.srt.models.gpt_oss import GptOssSparseMoeBlock
    from transformers import AutoConfig

    from kt_sglang.layer.hybrid import DeferralChain, HybridMoELayer

    config = AutoConfig.from_pretrained(model_dir)
    quant_config = Mxfp4Config.from_config(config.quantization_config)
    block = GptOssSparseMoeBlock(layer_id=0, config=config, quant_config=quant_config, prefix=PREFIX[:-1])
    load_expert_weights(block, config, tensors)
    method, fused = block.experts.quant_method, block.experts
    result = {
        "wrapper": type(method).__module__ + "." + type(method).__name__,
        "gpu_method": type(method.gpu_method).__name__,
        "activation": str(method.wrapper.activation),
        "hot_experts": method.hot_experts,
        "gpu_slots": {name: int(getattr(fused, name).shape[0]) for name in CHECKPOINT_NAME},
        "slots_match": all(
            torch.equal(getattr(fused, name)[slot], as_loaded(tensors[PREFIX + ckpt][e]))
            for slot, e in enumerate(method.hot_experts)
            for name, ckpt in CHECKPOINT_NAME.items()
        ),
    }
    if args.hot:  # hot MXFP4 experts do not compute on the CPU device (the test's docstring)
        try:
            method.attach(fused, DeferralChain())
        except ValueError as exc:  # the plugin refuses them rather than compute another function
            result["attach_error"] = str(exc)
        # SGLang's triton_kernels MXFP4 post-load replaces w13_weight / w2_weight (on CUDA): the
        # hybrid layer must still build there; on the CPU device it is refused, naming why.
        del fused.w13_weight, fused.w2_weight
        try:
            method.attach(fused, DeferralChain())
        except ValueError as exc:
            result["attach_error_without_weights"] = str(exc)
        print(json.dumps(result), flush=True)
        return

    method.process_weights_after_loading(fused)
    method.attach(fused, DeferralChain())
    HybridMoELayer.link([method.hybrid])

    reference = reference_block(tensors)
    # bf16 router logits (SGLang's) and float32 ones (the reference's) order near-tied experts
    # differently; such a token's output differs by a whole expert. Compare tokens whose k-th and
    # (k+1)-th logits are further apart than bf16 rounding can move them.
    torch.manual_seed(1)
    candidates = torch.randn(4 * T, H).to(torch.bfloat16)
    with torch.no_grad():
        top = torch.topk(reference.router(candidates.float())[0], K + 1, dim=-1).values
    x = candidates[top[:, K - 1] - top[:, K] > MARGIN][:T]
    assert x.shape[0] == T

    with torch.no_grad():
        out = block(x).float()
        xf = x.float()
        ref, _ = reference(xf[None])
        without_biases, _ = reference_block(tensors, biases=False)(xf[None])
        logits, _, ids = reference.router(xf)
        experts = reference.experts
        unrenormalized = experts(xf, ids, torch.softmax(logits, -1).gather(1, ids))
        bias_free_logits = logits - reference.router.bias
        ids_without_bias = torch.topk(bias_free_logits, K, dim=-1).indices
        weights_without_bias = torch.softmax(bias_free_logits.gather(1, ids_without_bias), -1)
        router_without_bias = experts(xf, ids_without_bias, weights_without_bias)
        experts._apply_gate = plain_silu
        with_plain_silu = experts(xf, ids, torch.softmax(logits.gather(1, ids), -1))
        experts._apply_gate = halves_swiglu(experts)
        with_halves = experts(xf, ids, torch.softmax(logits.gather(1, ids), -1))
        del experts._apply_gate
        experts.limit = float("inf")
        unclamped = experts(xf, ids, torch.softmax(logits.gather(1, ids), -1))
        experts.limit = LIMIT
        gate = (
            torch.einsum("th,ehi->tei", xf, experts.gate_up_proj[:, :, ::2])
            + experts.gate_up_proj_bias[:, ::2]
        )
        clamped = float((gate.gather(1, ids[..., None].expand(-1, -1, I)) > LIMIT).float().mean())

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    result |= {
        "clamped_fraction": clamped,
        "rel_err": rel(out, ref[0]),
        "rel_err_vs_plain_silu": rel(out, with_plain_silu),
        "rel_err_vs_halves": rel(out, with_halves),
        "rel_err_vs_unclamped": rel(out, unclamped),
        "rel_err_vs_without_biases": rel(out, without_biases[0]),
        "rel_err_vs_router_without_bias": rel(out, router_without_bias),
        "rel_err_vs_unrenormalized": rel(out, unrenormalized),
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
