"""Builds SGLang's DeepSeek-V4 MoE blocks (`DeepseekV2MoE` with `is_deepseek_v4=True`) in this process
with the plugin loaded and compares them with HF transformers' `DeepseekV4SparseMoeBlock` on the same
weights; prints one JSON line.

DeepSeek-V4's attention (compressed sparse attention, hyper-connections) does not serve on SGLang's
CPU path, so the check is at the MoE block, for both kinds of layer: layer 0 routes by a frozen
token-id table (`HashTopK`, `num_hash_layers` 1), layer 1 by the top-k of sqrt(softplus(logits)) plus
a correction bias, ungrouped. Routing and `routed_scaling_factor` are SGLang's; the routed experts
are our wrapper, all cold, reading the DeepSeek-V4-Flash checkpoint as it ships (MXFP4
`layers.{l}.ffn.experts.{e}.w1/w3/w2` with e8m0 `.scale`, SiLU with gate and up clamped at
swiglu_limit) with `--kt-method MXFP4`. The router's and shared expert's tensors go through SGLang's
own renaming of the release's names (`DeepseekV4ForCausalLM.remap_weight_name_to_dpsk_hf_format`)
and the block's weight loaders. SGLang computes the shared expert's clamped SiLU with a CUDA JIT
kernel only (`silu_and_mul_clamp`), so the blocks run with `skip_shared_experts=True` against the
reference less its shared expert; the shared expert's loaded weights are compared with the
checkpoint's. SGLang's fused hash top-k is a CUDA JIT kernel too: its torch path
(`SGLANG_OPT_USE_FUSED_HASH_TOPK=0`) routes the hash layer here. Run by
tests/test_sglang_deepseek_v4_block.py in a subprocess.

usage: sglang_deepseek_v4_block_worker.py WORKDIR --port 29655
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from sglang_moe_block_worker import load_dense_tensor, load_plugin, process_after_loading, start_sglang

E, K, H, I = 16, 4, 256, 128
VOCAB = 512
LIMIT = 7.0
SCALING = 1.5
T = 32  # tokens compared per layer
MARGIN = 0.02  # least gap between a token's k-th and (k+1)-th routing score (see main())
E2M1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]


def release_config() -> dict:
    """config.json as DeepSeek-V4-Flash ships it, with the keys SGLang's MoE block reads."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": VOCAB,
        "hidden_size": H,
        "moe_intermediate_size": I,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 64,
        "o_lora_rank": 64,
        "o_groups": 2,
        "index_n_heads": 4,
        "index_head_dim": 32,
        "index_topk": 8,
        "sliding_window": 128,
        "compress_ratios": [0, 4],
        "compress_rope_theta": 160000.0,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 4096,
        "n_routed_experts": E,
        "n_shared_experts": 1,
        "num_experts_per_tok": K,
        "num_hash_layers": 1,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": SCALING,
        "swiglu_limit": LIMIT,
        "hidden_act": "silu",
        "expert_dtype": "fp4",
        "torch_dtype": "bfloat16",
    }


def reference_config(**overrides):
    """transformers' config of the same model (it folds `num_hash_layers` into `mlp_layer_types`)."""
    from transformers import DeepseekV4Config

    return DeepseekV4Config(**(release_config() | overrides))


def mxfp4(
    gen: torch.Generator, n: int, k: int, centre: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random e2m1 codes for [n, k] as DeepSeek-V4-Flash ships them: packed int8 [n, k/2] (element 2j
    in the low nibble), e8m0 scales [n, k/32] about 2^(centre - 127); and their float32 values,
    dequantized here."""
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    exps = (torch.randint(-1, 2, (n, k // 32), generator=gen) + centre).to(torch.uint8)
    values = torch.tensor(E2M1)[codes.long()] * torch.exp2(exps.float() - 127).repeat_interleave(32, -1)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)
    return packed, exps.view(torch.float8_e8m0fnu), values


def write_checkpoint(directory: Path) -> tuple[dict[str, torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
    """Layers 0 (hash-routed) and 1 (top-k) of a DeepSeek-V4-Flash checkpoint under the release's
    names; returns the tensors and, per layer, the float32 state of HF's block."""
    gen = torch.Generator().manual_seed(0)
    tensors, states = {}, {}
    for layer in (0, 1):
        p = f"layers.{layer}.ffn."
        state = {"gate.weight": torch.randn(E, H, generator=gen) * 0.1}
        tensors[p + "gate.weight"] = state["gate.weight"].bfloat16()
        if layer == 0:
            tid2eid = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(VOCAB)])
            tensors[p + "gate.tid2eid"] = tid2eid.int()
            state["gate.tid2eid"] = tid2eid
        else:
            bias = torch.randn(E, generator=gen) * 0.1
            tensors[p + "gate.bias"] = bias.float()
            state["gate.e_score_correction_bias"] = bias
        values = {}
        # Scales near 2^-3 (gate, up) give pre-activations of several units: the clamp is reached.
        for proj, w, n, k, centre in (
            ("gate", "w1", I, H, 124),
            ("up", "w3", I, H, 124),
            ("down", "w2", H, I, 122),
        ):
            values[proj] = []
            for e in range(E):
                packed, scale, v = mxfp4(gen, n, k, centre)
                tensors[f"{p}experts.{e}.{w}.weight"] = packed
                tensors[f"{p}experts.{e}.{w}.scale"] = scale
                values[proj].append(v)
        state["experts.gate_up_proj"] = torch.cat([torch.stack(values["gate"]), torch.stack(values["up"])], 1)
        state["experts.down_proj"] = torch.stack(values["down"])
        for proj, w, shape in (
            ("gate_proj", "w1", (I, H)),
            ("up_proj", "w3", (I, H)),
            ("down_proj", "w2", (H, I)),
        ):
            weight = (torch.randn(*shape, generator=gen) * 4 / shape[1] ** 0.5).bfloat16()
            tensors[f"{p}shared_experts.{w}.weight"] = weight
            state[f"shared_experts.{proj}.weight"] = weight.float()
        states[layer] = state
    directory.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(release_config(), indent=1))
    return tensors, states


def reference_block(state: dict[str, torch.Tensor], layer: int, **overrides) -> torch.nn.Module:
    """HF's float32 `DeepseekV4SparseMoeBlock` of `layer` on the checkpoint's values."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock

    block = DeepseekV4SparseMoeBlock(reference_config(**overrides), layer).float()
    block.load_state_dict(state)
    return block


def load_block_weights(block: torch.nn.Module, layer: int, tensors: dict[str, torch.Tensor]) -> list[str]:
    """The router's and shared expert's tensors, renamed by SGLang's DeepSeek-V4 loader, through the
    block's weight loaders; the routed experts are read by our wrapper from the checkpoint itself.
    Returns the SGLang names loaded."""
    from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM

    prefix = f"model.layers.{layer}.mlp."
    params = dict(block.named_parameters())
    loaded = []
    for name, w in tensors.items():
        if not name.startswith(f"layers.{layer}.") or ".experts." in name.replace("shared_experts", ""):
            continue
        local = DeepseekV4ForCausalLM.remap_weight_name_to_dpsk_hf_format(name).removeprefix(prefix)
        load_dense_tensor(params, local, w)
        loaded.append(local)
    process_after_loading(block)
    return sorted(loaded)


def routing_scores(reference: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What the top-k router ranks: sqrt(softplus(logits)) plus the correction bias."""
    gate = reference.gate
    return torch.nn.functional.softplus(x @ gate.weight.T).sqrt() + gate.e_score_correction_bias


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--port", type=int, default=29655)
    args = parser.parse_args()
    os.environ["SGLANG_OPT_USE_FUSED_HASH_TOPK"] = "0"

    model_dir = args.workdir / "deepseek-v4-block"
    tensors, states = write_checkpoint(model_dir)
    load_plugin(model_dir, "MXFP4", 0, "uniform")
    start_sglang(model_dir, "MXFP4", 0, args.port)

    from sglang.srt.models.deepseek_v2 import DeepseekV2MoE
    from sglang.srt.utils.hf_transformers_utils import get_config

    from kt_sglang.layer.hybrid import DeferralChain, HybridMoELayer

    config = get_config(str(model_dir), trust_remote_code=False)  # what SGLang's server reads
    blocks, result = {}, {"layers": {}}
    for layer in (0, 1):
        block = DeepseekV2MoE(config, layer_id=layer, prefix=f"model.layers.{layer}.mlp", is_deepseek_v4=True)
        block = block.to(torch.bfloat16)
        loaded = load_block_weights(block, layer, tensors)
        method = block.experts.quant_method
        method.attach(block.experts, DeferralChain())
        blocks[layer] = block
        p = f"layers.{layer}.ffn.shared_experts."
        shared_gate_up = torch.cat([tensors[p + "w1.weight"], tensors[p + "w3.weight"]])
        result["layers"][layer] = {
            "topk": type(block.topk).__name__,
            "shared_loaded": torch.equal(block.shared_experts.gate_up_proj.weight, shared_gate_up)
            and torch.equal(block.shared_experts.down_proj.weight, tensors[p + "w2.weight"]),
            "loaded": loaded,
            "activation": str(method.wrapper.activation),
            "gpu_slots": int(block.experts.w13_weight.shape[0]),
        }
    result["wrapper"] = type(method).__module__ + "." + type(method).__name__
    HybridMoELayer.link([blocks[layer].experts.quant_method.hybrid for layer in (0, 1)])

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    torch.manual_seed(1)
    for layer, block in blocks.items():
        reference = reference_block(states[layer], layer)
        candidates = torch.randn(4 * T, H).to(torch.bfloat16)
        ids = torch.randint(0, VOCAB, (4 * T,))
        if layer == 1:
            # bf16 router logits (SGLang's) and float32 ones (the reference's) order near-tied
            # experts differently; such a token's output differs by a whole expert. Compare tokens
            # whose k-th and (k+1)-th scores are further apart than bf16 rounding can move them.
            with torch.no_grad():
                top = torch.topk(routing_scores(reference, candidates.float()), K + 1, dim=-1).values
            keep = top[:, K - 1] - top[:, K] > MARGIN
            candidates, ids = candidates[keep], ids[keep]
        x, ids = candidates[:T], ids[:T]
        assert x.shape[0] == T
        xf = x.float()[None]
        with torch.no_grad():
            out = block(x, input_ids_global=ids, skip_shared_experts=True).float()
            shared = reference.shared_experts(xf)[0]
            ref = reference(xf, input_ids=ids[None])[0] - shared
            variants = {
                "unscaled": reference_block(states[layer], layer, routed_scaling_factor=1.0),
                "unclamped": reference_block(states[layer], layer, swiglu_limit=float("inf")),
                "sigmoid_scores": reference_block(states[layer], layer, scoring_func="sigmoid"),
                # the other kind of routing for this layer
                "other_routing": reference_block(
                    {k: v for k, v in states[layer].items() if not k.startswith("gate.")}
                    | ({"gate.weight": states[layer]["gate.weight"]})
                    | (
                        {"gate.e_score_correction_bias": torch.zeros(E)}
                        if layer == 0
                        else {"gate.tid2eid": torch.randint(0, E, (VOCAB, K))}
                    ),
                    layer,
                    num_hash_layers=0 if layer == 0 else 2,
                ),
            }
            errors = {
                f"rel_err_vs_{name}": rel(out, b(xf, input_ids=ids[None])[0] - shared)
                for name, b in variants.items()
            }
            experts = reference.experts
            gate = torch.einsum("th,eih->tei", xf[0], experts.gate_up_proj[:, :I])
            if layer == 0:
                chosen = reference.gate.tid2eid[ids]
            else:
                chosen = torch.topk(routing_scores(reference, xf[0]), K, dim=-1).indices
            clamped = float((gate.gather(1, chosen[..., None].expand(-1, -1, I)) > LIMIT).float().mean())
        result["layers"][layer] |= {"rel_err": rel(out, ref), "clamped_fraction": clamped}
        result["layers"][layer] |= errors
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
