"""Fine-tuning a transformers MoE model: the engine's LoRA experts inside HF's own forward and an
ordinary optimizer loop, against a float32 torch twin of the experts; adapters saved in PEFT's
format and loaded by PEFT itself."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from kt_sglang.engine.reference import relative_error
from kt_sglang.finetune.adapter import AdapterError, ExpertAdapter
from kt_sglang.finetune.hf import attach_lora_experts, load_expert_adapter, save_expert_adapter

E, K, H, I = 8, 2, 64, 32


def tiny_model(seed: int = 0) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=96, hidden_size=H, intermediate_size=128, moe_intermediate_size=I, num_experts=E,
        num_experts_per_tok=K, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        max_position_embeddings=64, norm_topk_prob=True,
    )  # fmt: skip
    return _bf16_experts(Qwen3MoeForCausalLM(config))


def tiny_mixtral(seed: int = 0):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(
        vocab_size=96, hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        max_position_embeddings=64,
    )  # fmt: skip
    return _bf16_experts(MixtralForCausalLM(config))


def tiny_deepseek_v3(seed: int = 0):
    """A dense first layer, then a MoE layer with a shared expert (which stays in torch)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV3Config(
        vocab_size=96, hidden_size=H, intermediate_size=96, moe_intermediate_size=I, n_routed_experts=E,
        num_experts_per_tok=K, n_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1, max_position_embeddings=64,
    )  # fmt: skip
    return _bf16_experts(DeepseekV3ForCausalLM(config))


def _bf16_experts(model):
    model = model.float().eval()
    with torch.no_grad():  # the engine's BF16 method holds bf16 weights: give the twin the same values
        for layer in model.model.layers:
            experts = getattr(layer.mlp, "experts", None)
            if experts is None:
                continue  # a dense layer
            for p in (experts.gate_up_proj, experts.down_proj):
                p.copy_(p.bfloat16().float() * 4)  # larger experts: their share of the output is visible
    return model


class TorchLoRAExperts(torch.nn.Module):
    """The float32 reference of LoRAExperts: transformers' per-expert loop plus the adapters."""

    def __init__(self, experts: torch.nn.Module, adapters: list[torch.Tensor], scale: float) -> None:
        super().__init__()
        self.gate_up = experts.gate_up_proj.detach().clone()
        self.down = experts.down_proj.detach().clone()
        self.inter = self.down.shape[2]
        names = ("gate_lora_a", "gate_lora_b", "up_lora_a", "up_lora_b", "down_lora_a", "down_lora_b")
        for name, t in zip(names, adapters, strict=True):
            self.register_parameter(name, torch.nn.Parameter(t.detach().clone().float()))
        self.scale = scale

    def forward(self, hidden, ids, weights):
        out = torch.zeros_like(hidden)
        s, I = self.scale, self.inter
        for e in ids.unique().tolist():
            tok, slot = (ids == e).nonzero(as_tuple=True)
            x = hidden[tok]
            g = x @ self.gate_up[e, :I].T + s * (x @ self.gate_lora_a[e].T) @ self.gate_lora_b[e].T
            u = x @ self.gate_up[e, I:].T + s * (x @ self.up_lora_a[e].T) @ self.up_lora_b[e].T
            h = torch.nn.functional.silu(g) * u
            y = h @ self.down[e].T + s * (h @ self.down_lora_a[e].T) @ self.down_lora_b[e].T
            out = out.index_add(0, tok, y * weights[tok, slot, None])
        return out


def engine_and_twin(train_router: bool = False, make=tiny_model):
    model = make()
    twin = copy.deepcopy(model)
    modules = attach_lora_experts(model, rank=4, alpha=8.0, seed=1, train_router=train_router)
    gen = torch.Generator().manual_seed(2)
    twins = []
    for name, m in modules.items():
        with torch.no_grad():
            for p in (m.gate_lora_b, m.up_lora_b, m.down_lora_b):  # a trained-looking start, not B = 0
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        parent, _, attr = name.rpartition(".")
        reference = TorchLoRAExperts(twin.get_submodule(name), list(m.adapters), scale=2.0)
        setattr(twin.get_submodule(parent), attr, reference)
        twins.append(reference)
    for p in twin.parameters():
        p.requires_grad_(False)
    for r in twins:
        for p in r.parameters():
            p.requires_grad_(True)
    if train_router:
        for layer in twin.model.layers:
            layer.mlp.gate.weight.requires_grad_(True)
    return model, modules, twin, twins


def batch(seed: int = 3, T: int = 24):
    ids = torch.randint(0, 96, (2, T), generator=torch.Generator().manual_seed(seed))
    return ids


def check_step_against_twin(model, modules, twin, twins) -> None:
    """One forward and backward: the loss and every adapter's gradient follow the float32 twin."""
    ids = batch()
    loss = model(input_ids=ids, labels=ids).loss
    ref = twin(input_ids=ids, labels=ids).loss
    assert abs(loss.item() - ref.item()) < 1e-2 * ref.item()
    loss.backward()
    ref.backward()
    for m, r in zip(modules.values(), twins, strict=True):
        for p, q in zip(m.adapters, r.parameters(), strict=True):  # the same order of the six adapters
            assert relative_error(p.grad, q.grad) < 2e-2


def test_forward_and_backward_inside_transformers():
    model, modules, twin, twins = engine_and_twin(train_router=True)
    check_step_against_twin(model, modules, twin, twins)
    for layer, ref_layer in zip(model.model.layers, twin.model.layers, strict=True):  # the router trains
        assert relative_error(layer.mlp.gate.weight.grad, ref_layer.mlp.gate.weight.grad) < 2e-2
    # Nothing else trains.
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert all("lora" in n or n.endswith("mlp.gate.weight") for n in trainable)


@pytest.mark.parametrize("make", [tiny_mixtral, tiny_deepseek_v3], ids=["mixtral", "deepseek_v3"])
def test_other_families_train_like_their_float32_twin(make):
    """Mixtral's and DeepSeek-V3's MoE blocks (a dense first layer, a shared expert in torch) call the
    engine's experts as Qwen3-MoE's do: the loss and every adapter's gradient follow the twin."""
    model, modules, twin, twins = engine_and_twin(make=make)
    assert list(modules) == [n for n, _ in twin.named_modules() if n.endswith("mlp.experts")]
    check_step_against_twin(model, modules, twin, twins)


def test_adamw_steps_match_the_float32_twin():
    model, modules, twin, twins = engine_and_twin()
    params = [p for m in modules.values() for p in m.adapters]
    ref_params = [p for r in twins for p in r.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref_params, lr=1e-2)
    losses, ref_losses = [], []
    ids = batch(seed=10)
    for _ in range(4):
        for o, m, store in ((opt, model, losses), (ref_opt, twin, ref_losses)):
            o.zero_grad(set_to_none=True)
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            o.step()
            store.append(loss.item())
    for loss, ref in zip(losses, ref_losses, strict=True):
        assert abs(loss - ref) < 1e-2 * ref
    assert losses[-1] < losses[0]  # (Adam's per-entry normalization amplifies rounding in tiny
    # gradients, so the adapters themselves are compared through the losses, not entry by entry)


def test_micro_batches_accumulate_in_grad():
    model, modules, *_ = engine_and_twin()
    first = next(iter(modules.values()))
    model(input_ids=batch(seed=5), labels=batch(seed=5)).loss.backward()
    once = first.down_lora_b.grad.clone()
    model(input_ids=batch(seed=5), labels=batch(seed=5)).loss.backward()
    assert relative_error(first.down_lora_b.grad, 2 * once) < 1e-5


def test_abandoned_step_frees_its_saved_state():
    model, modules, *_ = engine_and_twin()
    wrapper = next(iter(modules.values())).wrapper
    loss = model(input_ids=batch(), labels=batch()).loss
    assert wrapper.cache_depth == 1
    del loss  # the graph goes, and with it what the forward kept
    assert wrapper.cache_depth == 0
    with torch.no_grad():
        model(input_ids=batch(), labels=batch())
    assert wrapper.cache_depth == 0


def test_peft_loads_the_saved_adapter(tmp_path):
    from peft import PeftModel

    model, modules, *_ = engine_and_twin()
    ids = batch()
    with torch.no_grad():
        ours = model(input_ids=ids).logits
    save_expert_adapter(modules, tmp_path / "adapter")
    peft_model = PeftModel.from_pretrained(tiny_model(), tmp_path / "adapter").eval()
    with torch.no_grad():
        theirs = peft_model(input_ids=ids).logits
        base = tiny_model()(input_ids=ids).logits
    assert relative_error(ours, theirs) < 1e-2
    assert relative_error(base, theirs) > 5e-2  # the adapter changes the model

    # Merged into the weights (what serving does): the same logits.
    adapter = ExpertAdapter(tmp_path / "adapter")
    merged = tiny_model()
    with torch.no_grad():
        for layer_idx, layer in enumerate(merged.model.layers):
            dg, du, dd = adapter.deltas(layer_idx, list(range(E)), E, H, I)
            layer.mlp.experts.gate_up_proj += torch.cat([dg, du], dim=1)
            layer.mlp.experts.down_proj += dd
        assert relative_error(merged(input_ids=ids).logits, theirs) < 1e-3

    # Resuming: the adapters come back into fresh modules.
    again = attach_lora_experts(tiny_model(), rank=4, alpha=8.0, seed=9)
    load_expert_adapter(again, tmp_path / "adapter")
    for a, b in zip(modules.values(), again.values(), strict=True):
        for p, q in zip(a.adapters, b.adapters, strict=True):
            assert torch.equal(p.detach(), q.detach())

    # PEFT's own save of the loaded adapter reads back to the same deltas.
    peft_model.save_pretrained(tmp_path / "resaved")
    again_deltas = ExpertAdapter(tmp_path / "resaved").deltas(0, list(range(E)), E, H, I)
    for a, b in zip(adapter.deltas(0, list(range(E)), E, H, I), again_deltas, strict=True):
        assert relative_error(a, b) < 1e-6


def test_bad_adapter_directories(tmp_path):
    with pytest.raises(AdapterError, match="adapter_config.json is missing"):
        ExpertAdapter(tmp_path)
    _, modules, *_ = engine_and_twin()
    save_expert_adapter(modules, tmp_path / "a")
    adapter = ExpertAdapter(tmp_path / "a")
    with pytest.raises(AdapterError, match="this model's 16 experts"):
        adapter.deltas(0, [0], 16, H, I)
    with pytest.raises(AdapterError, match="need A"):
        adapter.deltas(0, [0], E, H + 8, I)


@pytest.mark.slow
def test_finetune_command_lowers_the_held_out_loss_and_serves_it(tmp_path):
    """`kt-sglang finetune` on the Shakespeare model and a held-out play: the play's held-out loss
    falls; the adapter it writes, merged into the experts as serving merges it, gives that loss again
    in BF16 and keeps most of the gain in the quantized methods."""
    from kt_sglang.cli.main import main

    out = tmp_path / "ft"
    argv = ["finetune", "--steps", "6", "--batch", "4", "--context", "64", "--eval-every", "3"]
    assert main([*argv, "--serve-methods", "BF16", "AMXINT8", "--out", str(out)]) == 0
    record = json.loads((out / "finetune.json").read_text())
    before, after = record["held_out_loss_before"], record["held_out_loss_after"]
    assert after < before - 0.05, (before, after)
    assert record["curve"]["step"] == [0, 3, 6] and len(record["curve"]["train_loss"]) == 6
    served = record["served"]
    assert abs(served["BF16"]["base"] - before) < 2e-3
    assert abs(served["BF16"]["merged"] - after) < 2e-3  # the engine's LoRA forward == the merged weights
    assert served["AMXINT8"]["merged"] < served["AMXINT8"]["base"] - 0.04
    assert ExpertAdapter(out / "adapter").layers == [0, 1, 2, 3]
