"""Runs kt-kernel 0.7.2 itself for tests/test_kt_kernel_dirs.py, in kt-kernel's environment (the
interpreter KT_SGLANG_KT_KERNEL_PYTHON names; it imports only torch and kt_kernel).

  write DIR METHOD PARTS H I E SEED    quantizes random N(0, 1/fan_in) bf16 experts of layer 0 with
                                       kt-kernel and saves them as it does (``_layer_0/_numa_P/*.kt``);
                                       the bf16 weights go to DIR/dense.pt
  convert MODEL OUT METHOD PARTS      every MoE layer of a Hugging Face Qwen3-MoE / Mixtral-style model
                                       directory (``model.layers.L.mlp.experts.E.*_proj.weight``),
                                       quantized and saved by kt-kernel as its converter does
  forward DIR METHOD PARTS H I E K T SEED OUT
                                       loads DIR as kt-kernel loads a converted directory and saves
                                       its output for T random tokens (inputs too) to OUT

It calls kt-kernel's engine below its Python wrapper (which needs a CUDA device), as the wrapper does.
"""

from __future__ import annotations

import os
import sys

import torch


def _layer(method: str, parts: int, H: int, I: int, E: int, top_k: int, max_len: int, layer_idx=0, **config):
    import kt_kernel  # noqa: F401  (loads the kt_kernel_ext build this CPU runs)
    import kt_kernel_ext
    import kt_kernel_ext.moe as moe

    pool = kt_kernel_ext.WorkerPoolConfig()
    pool.subpool_count, pool.subpool_numa_map, pool.subpool_thread_count = parts, [0] * parts, [1] * parts
    cpu = kt_kernel_ext.CPUInfer(pool)
    mask = torch.zeros(E, dtype=torch.bool)
    cfg = moe.MOEConfig(E, top_k, H, I, mask.data_ptr())
    cfg.layer_idx, cfg.pool, cfg.max_len = layer_idx, cpu.backend_, max_len
    for name, value in config.items():
        setattr(cfg, name, value)
    layer = {"AMXINT8": moe.AMXInt8_MOE, "AMXINT4": moe.AMXInt4_MOE}[method](cfg)
    identity = torch.arange(E, dtype=torch.int64)
    cpu.submit(layer.load_weights_task(identity.data_ptr()))
    cpu.sync()
    return cpu, layer, mask


def _save(method, parts, H, I, E, layer_idx, out, gate, up, down) -> None:
    """kt-kernel quantizes bf16 experts and saves them, as its converter does (save mode)."""
    _layer(
        method, parts, H, I, E, 1, 64, layer_idx=layer_idx, save=True, load=False, path=out,
        gate_proj=gate.data_ptr(), up_proj=up.data_ptr(), down_proj=down.data_ptr(),
    )  # fmt: skip


def write(out: str, method: str, parts: str, H: str, I: str, E: str, seed: str) -> None:
    parts, H, I, E = int(parts), int(H), int(I), int(E)
    gen = torch.Generator().manual_seed(int(seed))
    gate = (torch.randn(E, I, H, generator=gen) / H**0.5).bfloat16()
    up = (torch.randn(E, I, H, generator=gen) / H**0.5).bfloat16()
    down = (torch.randn(E, H, I, generator=gen) / I**0.5).bfloat16()
    _save(method, parts, H, I, E, 0, out, gate, up, down)
    torch.save({"gate": gate, "up": up, "down": down}, os.path.join(out, "dense.pt"))


def convert(model: str, out: str, method: str, parts: str) -> None:
    import json
    import re
    from pathlib import Path

    from safetensors import safe_open

    tensors = {}
    for f in sorted(Path(model).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for name in h.keys():
                m = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$", name)
                if m:
                    tensors[int(m[1]), int(m[2]), m[3]] = h.get_tensor(name).bfloat16()
    config = json.loads((Path(model) / "config.json").read_text())
    H = config["hidden_size"]
    I = config.get("moe_intermediate_size") or config["intermediate_size"]
    for layer in sorted({key[0] for key in tensors}):
        E = 1 + max(key[1] for key in tensors if key[0] == layer)
        gate, up, down = (
            torch.stack([tensors[layer, e, proj] for e in range(E)]).contiguous()
            for proj in ("gate", "up", "down")
        )
        _save(method, int(parts), H, I, E, layer, out, gate, up, down)


def forward(path, method, parts, H, I, E, top_k, T, seed, out) -> None:
    parts, H, I, E, top_k, T = (int(v) for v in (parts, H, I, E, top_k, T))
    cpu, layer, _mask = _layer(
        method, parts, H, I, E, top_k, -(-max(T, 64) // 32) * 32, save=False, load=True, path=path
    )
    gen = torch.Generator().manual_seed(int(seed))
    x = torch.randn(T, H, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(T)]).contiguous()
    w = torch.rand(T, top_k, generator=gen)
    w = (w / w.sum(-1, keepdim=True)).contiguous()
    y = torch.empty(T, H, dtype=torch.bfloat16)
    batch = torch.tensor([T], dtype=torch.int32)
    cpu.submit(
        layer.forward_task(
            batch.data_ptr(), top_k, ids.data_ptr(), w.data_ptr(), x.data_ptr(), y.data_ptr(), False
        )
    )
    cpu.sync()
    torch.save({"x": x, "ids": ids, "weights": w, "y": y}, out)


if __name__ == "__main__":
    {"write": write, "convert": convert, "forward": forward}[sys.argv[1]](*sys.argv[2:])
