"""Builds SGLang's DeepSeek-V3 MoE block (`DeepseekV2MoE`) in this process with the plugin loaded and
compares it with HF transformers' `DeepseekV3MoE` on the same weights; prints one JSON line.

MLA attention does not serve on SGLang's CPU path, so the DeepSeek-V3 check is at the layer: the
block's grouped sigmoid router, shared expert and `routed_scaling_factor` are SGLang's; its routed
experts are our wrapper (hot ones in GPU slots, loaded through SGLang's FusedMoE weight loader and
our hook, cold ones on the CPU engine). Run by tests/test_sglang_moe_block.py in a subprocess:
SGLang's process-wide context and process groups stay out of the test process.

usage: sglang_moe_block_worker.py WORKDIR --method BF16 --placement random --hot 3 --port 29655

With ``--placement heat`` the block first runs ``--steps`` forwards of skewed routing (inputs drawn
near one expert's router row), the plugin's placement stepping after each as after a model forward;
the output and the slots are then checked against the moved hot set.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

PREFIX = "model.layers.1.mlp."  # layer 0 is dense (first_k_dense_replace=1)
E, K, H, I = 8, 2, 128, 64


def reference_config():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        architectures=["DeepseekV3ForCausalLM"],
        vocab_size=512,
        hidden_size=H,
        intermediate_size=4 * I,
        moe_intermediate_size=I,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=E,
        n_shared_experts=1,
        num_experts_per_tok=K,
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        topk_method="noaux_tc",  # what DeepSeek-V3's config.json says; SGLang reads these two
        scoring_func="sigmoid",
        dtype="bfloat16",
    )


def write_checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    """HF's block, randomly initialized, saved with DeepSeek's per-expert tensor names (bf16)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = reference_config()
    torch.manual_seed(0)
    block = DeepseekV3MoE(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(std=0.05)
        block.gate.e_score_correction_bias.normal_(std=0.1)
    state = {k: v.to(torch.bfloat16) for k, v in block.state_dict().items()}
    gate_up, down = state.pop("experts.gate_up_proj"), state.pop("experts.down_proj")  # [E, 2I, H], [E, H, I]
    for e in range(E):
        state[f"experts.{e}.gate_proj.weight"] = gate_up[e, :I]
        state[f"experts.{e}.up_proj.weight"] = gate_up[e, I:]
        state[f"experts.{e}.down_proj.weight"] = down[e]
    tensors = {PREFIX + k: v.contiguous() for k, v in state.items()}
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "model.safetensors")
    config.save_pretrained(directory)
    return tensors


def reference_block(tensors: dict[str, torch.Tensor], **overrides) -> torch.nn.Module:
    """HF's float32 `DeepseekV3MoE` on the checkpoint's weights."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = reference_config()
    for key, value in overrides.items():
        setattr(config, key, value)
    block = DeepseekV3MoE(config).float()
    t = {k[len(PREFIX) :]: v.float() for k, v in tensors.items()}
    state = {
        "experts.gate_up_proj": torch.stack(
            [
                torch.cat([t[f"experts.{e}.gate_proj.weight"], t[f"experts.{e}.up_proj.weight"]])
                for e in range(E)
            ]
        ),
        "experts.down_proj": torch.stack([t[f"experts.{e}.down_proj.weight"] for e in range(E)]),
    }
    state |= {k: v for k, v in t.items() if not k.startswith("experts.")}
    block.load_state_dict(state)
    return block


def load_plugin(model_dir: Path, method: str, hot: int, placement: str) -> None:
    """The plugin as a launched worker has it: the launcher's settings in the environment, then
    SGLang's plugin loading (our register() runs through the entry point)."""
    from sglang.srt.plugins import load_plugins

    from kt_sglang.sglang.settings import KtSettings

    KtSettings(
        weight_path=str(model_dir),
        method=method,
        cpuinfer=1,
        threadpool_count=1,
        num_gpu_experts=hot,
        gpu_experts_ratio=None,
        max_deferred_experts_per_token=0,
        numa_nodes=None,
        placement_strategy=placement,
        placement_stats=None,
        record_placement_stats=None,
        heat={"interval_steps": 1, "half_life_steps": 4.0} if placement == "heat" else None,
    ).to_env()
    load_plugins()


def start_sglang(model_dir: Path, method: str, hot: int, port: int) -> None:
    """SGLang's process context for one tp=1 CPU worker, as the launcher would publish it."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    reset_context()
    server_args = ServerArgs(
        model_path=str(model_dir),
        device="cpu",
        kt_weight_path=str(model_dir),
        kt_method=method,
        kt_cpuinfer=1,
        kt_threadpool_count=1,
        kt_num_gpu_experts=hot,
    )
    publish(server_args, role="test", ranks=SpawnRanks(world_rank=0))
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    initialize_model_parallel(backend="gloo")


def load_dense_tensor(params: dict[str, torch.nn.Parameter], local: str, w: torch.Tensor) -> None:
    """One tensor of a DeepSeek MoE block other than a routed expert's, under its SGLang name within
    the block: the shared expert's gate and up go into its merged gate_up_proj."""
    if local.startswith("shared_experts.") and ("gate_proj" in local or "up_proj" in local):
        target = params["shared_experts.gate_up_proj.weight"]
        target.weight_loader(target, w, 0 if "gate_proj" in local else 1)
    else:
        target = params[local]
        getattr(target, "weight_loader", lambda p, v: p.data.copy_(v))(target, w)


def process_after_loading(block: torch.nn.Module) -> None:
    """Each quantization method's post-load step, as SGLang's loader runs it."""
    for module in block.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)


def load_block_weights(block: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """What SGLang's DeepSeek loader does for one MoE block: FusedMoE's expert mapping and each
    parameter's weight_loader (our hook maps expert ids to slots), then post-load processing."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    params = dict(block.named_parameters())
    mapping = FusedMoE.make_expert_params_mapping(
        ckpt_gate_proj_name="gate_proj",
        ckpt_down_proj_name="down_proj",
        ckpt_up_proj_name="up_proj",
        num_experts=E,
    )
    for name, w in tensors.items():
        local = name[len(PREFIX) :]
        if local.startswith("experts."):
            param_name, weight_name, expert_id, shard_id = next(m for m in mapping if m[1] in local)
            target = local.replace(weight_name, param_name)
            params[target].weight_loader(params[target], w, target, shard_id=shard_id, expert_id=expert_id)
        else:
            load_dense_tensor(params, local, w)
    process_after_loading(block)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--method", default="BF16")
    parser.add_argument("--placement", default="uniform")
    parser.add_argument("--hot", type=int, default=3)
    parser.add_argument("--port", type=int, default=29655)
    parser.add_argument("--steps", type=int, default=0)
    args = parser.parse_args()

    model_dir = args.workdir / "deepseek-v3-block"
    tensors = write_checkpoint(model_dir)
    load_plugin(model_dir, args.method, args.hot, args.placement)
    start_sglang(model_dir, args.method, args.hot, args.port)

    from sglang.srt.models.deepseek_v2 import DeepseekV2MoE
    from transformers import AutoConfig

    from kt_sglang.layer.hybrid import DeferralChain, HybridMoELayer
    from kt_sglang.sglang.method import heat_placement
    from kt_sglang.sglang.settings import KtSettings

    block = DeepseekV2MoE(AutoConfig.from_pretrained(model_dir), layer_id=1, prefix=PREFIX[:-1])
    block = block.to(torch.bfloat16)
    load_block_weights(block, tensors)
    method = block.experts.quant_method
    method.attach(block.experts, DeferralChain())
    HybridMoELayer.link([method.hybrid])
    placement = heat_placement([method], KtSettings.from_env())
    started_hot = list(method.hot_experts)
    if placement is not None:
        # routing skewed towards the experts a cold expert's router row favours: tokens near row 6
        router = block.gate.weight.detach().float()
        gen = torch.Generator().manual_seed(2)
        for _ in range(args.steps):
            x = (router[6] * 8 + torch.randn(4, H, generator=gen)).to(torch.bfloat16)
            with torch.no_grad():
                block(x)
            placement.step()
        method.hot_experts = (method.hybrid.gpu_slot_of >= 0).nonzero().flatten().tolist()

    slots_match = all(
        torch.equal(
            block.experts.w13_weight[slot],
            torch.cat(
                [
                    tensors[f"{PREFIX}experts.{e}.gate_proj.weight"],
                    tensors[f"{PREFIX}experts.{e}.up_proj.weight"],
                ]
            ),
        )
        and torch.equal(block.experts.w2_weight[slot], tensors[f"{PREFIX}experts.{e}.down_proj.weight"])
        for e, slot in ((e, int(method.hybrid.gpu_slot_of[e])) for e in method.hot_experts)
    )

    # What DecodeCudaGraphRunner.__init__ does with its capture sizes (it needs CUDA to be built):
    # the plugin pointed its KTMoEWrapper at ours, so every layer gets pinned buffers per size.
    from sglang.srt.model_executor.runner import decode_cuda_graph_runner as graph_runner

    if graph_runner.KTRANSFORMERS_AVAILABLE:
        graph_runner.KTMoEWrapper.set_capture_batch_sizes([1, 2, 4, 8])
    capture_buffers = sorted(method.wrapper._sets[False].by_size)

    torch.manual_seed(1)
    x = torch.randn(32, H).to(torch.bfloat16)
    with torch.no_grad():
        out = block(x).float()
    with torch.no_grad():
        reference = reference_block(tensors)
        ref = reference(x.float())
        unscaled = reference_block(tensors, routed_scaling_factor=1.0)(x.float())
        without_shared = ref - reference.shared_experts(x.float())

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    print(
        json.dumps(
            {
                "wrapper": type(method).__module__ + "." + type(method).__name__,
                "hot_experts": method.hot_experts,
                "started_hot": started_hot,
                "moves": placement.moves if placement is not None else 0,
                "gpu_slots": int(block.experts.w13_weight.shape[0]),
                "slots_match": slots_match,
                "capture_buffers": capture_buffers,
                "rel_err": rel(out, ref),
                "rel_err_vs_unscaled": rel(out, unscaled),
                "rel_err_vs_without_shared": rel(out, without_shared),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
