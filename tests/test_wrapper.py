"""KTMoEWrapper picks the layer of its mode; the inference and fine-tuning layers are siblings built
from one configuration each."""

from __future__ import annotations

import pytest
import torch

from kt_sglang import KTMoEWrapper
from kt_sglang.engine import InferenceMoEWrapper, MoEConfig, SFTConfig, SFTMoEWrapper
from kt_sglang.engine.methods import Method

E, K, H, I = 8, 2, 256, 192


def test_the_mode_picks_the_layer():
    inference = KTMoEWrapper(0, E, K, H, I, None, 1, 1, method="BF16")
    sft = KTMoEWrapper(0, E, K, H, I, None, 1, 1, method="AMXBF16_SFT", mode="sft", lora_rank=8)
    assert type(inference) is InferenceMoEWrapper and type(sft) is SFTMoEWrapper
    assert isinstance(inference, KTMoEWrapper) and isinstance(sft, KTMoEWrapper)
    assert not isinstance(sft, InferenceMoEWrapper) and not isinstance(inference, SFTMoEWrapper)
    assert sft.method is Method.BF16 and sft.sft_method == "AMXBF16_SFT" and sft.lora_rank == 8
    with pytest.raises(ValueError, match="Unknown mode: 'train'. Supported modes: 'inference', 'sft'"):
        KTMoEWrapper(0, E, K, H, I, None, 1, 1, mode="train")


def test_a_configuration_builds_its_layer():
    mask = torch.zeros(E, dtype=torch.bool)
    mask[1] = True
    config = MoEConfig(3, E, K, H, I, mask, 1, 1, method="moe_int8", group_size=128)
    layer = InferenceMoEWrapper(config)
    assert layer.config is config and config.method is Method.AMXINT8
    assert (layer.layer_idx, layer.num_experts, layer.group_size) == (3, E, 128)
    assert not layer.holds(1) and layer.holds(0)
    sft = SFTMoEWrapper(SFTConfig(0, E, K, H, I, method="AMXINT8_SFT_SkipLoRA"))
    assert sft.method is Method.AMXINT8 and sft.skip_lora and sft.lora_rank == 16


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_experts_per_tok=9), "num_experts_per_tok=9 is larger than num_experts=8"),
        (dict(method="INT3"), "unknown method 'INT3'"),
        (dict(group_size=48), "group_size=48 is not allowed for AMXINT4"),
        (dict(gpu_experts_mask=torch.zeros(E, dtype=torch.int32)), "gpu_experts_mask has dtype torch.int32"),
    ],
)
def test_the_configuration_is_checked_without_building(kwargs, match):
    args = dict(
        layer_idx=0,
        num_experts=E,
        num_experts_per_tok=K,
        hidden_size=H,
        moe_intermediate_size=I,
        gpu_experts_mask=None,
        cpuinfer_threads=1,
        threadpool_count=1,
    )
    with pytest.raises(ValueError, match=match):
        MoEConfig(**(args | kwargs))


def test_fine_tuning_takes_no_merged_adapter():
    with pytest.raises(ValueError, match="expert_lora_path merges an adapter into inference weights"):
        SFTConfig(0, E, K, H, I, expert_lora_path="adapter")
