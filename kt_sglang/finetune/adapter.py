"""Expert adapters in PEFT's format: what fine-tuning saves and what serving merges.

Written as PEFT 0.21 saves LoRA on transformers' fused expert parameters (``target_parameters``):
per MoE layer, ``...experts.base_layer.lora_A/B.weight`` for ``gate_up_proj [E, 2I, H]`` and
``...experts.lora_A/B.weight`` for ``down_proj [E, H, I]``, with A ``[E * r, in]`` (expert-major)
and B ``[out, r * E]`` (expert e in columns e, e + E, ...). Gate and up have adapters of their own:
on ``gate_up_proj`` they are one adapter of rank 2r, ``A = [A_gate; A_up]`` and
``B = diag(B_gate, B_up)``, with ``alpha`` doubled so that the scale stays alpha / r
(``rank_pattern`` / ``alpha_pattern``). ``PeftModel.from_pretrained`` loads the directory as it is.

Read: that format (from us or from PEFT itself) and the per-expert one of models whose experts are
modules (``...experts.{e}.gate_proj.lora_A.weight``, also ``w1`` / ``w3`` / ``w2``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
TARGET_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


class AdapterError(ValueError):
    """An adapter directory cannot be read or does not fit the model; the message says why."""


@dataclass(frozen=True)
class ExpertLoRA:
    """One layer's adapters, kt-kernel's shapes: A_gate, A_up ``[E, r, H]``; B_gate, B_up ``[E, I, r]``;
    A_down ``[E, r, I]``; B_down ``[E, H, r]``; the scale alpha / r."""

    gate_a: torch.Tensor
    gate_b: torch.Tensor
    up_a: torch.Tensor
    up_b: torch.Tensor
    down_a: torch.Tensor
    down_b: torch.Tensor
    scale: float

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.gate_a, self.gate_b, self.up_a, self.up_b, self.down_a, self.down_b)


def _interleave(b: torch.Tensor) -> torch.Tensor:
    """[E, out, r] -> PEFT's [out, r * E] (expert e in columns e, e + E, ...)."""
    E, out, r = b.shape
    return b.permute(1, 2, 0).reshape(out, r * E)


def _deinterleave(b: torch.Tensor, E: int) -> torch.Tensor:
    """PEFT's [out, r * E] -> [E, out, r]."""
    out = b.shape[0]
    return b.reshape(out, -1, E).permute(2, 0, 1)


def save_adapter(
    layers: dict[str, ExpertLoRA], out: str | Path, rank: int, alpha: float, base_model: str | None = None
) -> Path:
    """Writes the adapters of each experts module (keyed by its path in the transformers model, e.g.
    ``model.layers.0.mlp.experts``) as a PEFT adapter directory."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for path, lora in layers.items():
        g_a, g_b, u_a, u_b, d_a, d_b = (t.detach().float().cpu() for t in lora.tensors())
        E, I, r = g_b.shape
        gate_up_a = torch.cat([g_a, u_a], dim=1).reshape(E * 2 * r, -1)
        gate_up_b = torch.zeros(E, 2 * I, 2 * r)
        gate_up_b[:, :I, :r], gate_up_b[:, I:, r:] = g_b, u_b
        prefix = PEFT_PREFIX + path
        tensors[prefix + ".base_layer.lora_A.weight"] = gate_up_a.contiguous()
        tensors[prefix + ".base_layer.lora_B.weight"] = _interleave(gate_up_b).contiguous()
        tensors[prefix + ".lora_A.weight"] = d_a.reshape(E * r, -1).contiguous()
        tensors[prefix + ".lora_B.weight"] = _interleave(d_b).contiguous()
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": [],
        "target_parameters": TARGET_PARAMETERS,
        "rank_pattern": {r".*\.gate_up_proj": 2 * rank},
        "alpha_pattern": {r".*\.gate_up_proj": 2 * alpha},
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out


class ExpertAdapter:
    """A PEFT adapter directory's expert adapters, as weight deltas per layer (merged at load)."""

    _NATIVE = re.compile(r"layers\.(\d+)\.(?:.*\.)?experts\.(base_layer\.)?lora_([AB])\.weight$")
    _PER_EXPERT = re.compile(
        r"layers\.(\d+)\.(?:.*\.)?experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.lora_([AB])\.weight$"
    )
    _PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        config_file, weights_file = self.path / CONFIG, self.path / WEIGHTS
        for f in (config_file, weights_file):
            if not f.is_file():
                raise AdapterError(f"{self.path} is not a PEFT adapter directory: {f.name} is missing")
        try:
            self.config = json.loads(config_file.read_text())
        except json.JSONDecodeError as exc:
            raise AdapterError(f"{config_file}: not JSON ({exc})") from None
        if self.config.get("peft_type", "LORA") != "LORA":
            raise AdapterError(f"{config_file}: peft_type {self.config.get('peft_type')!r}; only LORA merges")
        if self.config.get("use_dora"):
            raise AdapterError(f"{config_file}: DoRA adapters are not supported")
        self._file = weights_file
        self.native: dict[int, dict[str, str]] = {}  # layer -> {"gate_up_A": key, ...}
        self.per_expert: dict[int, dict[tuple[int, str, str], str]] = {}  # layer -> {(e, proj, AB): key}
        self.ignored: list[str] = []
        with safe_open(str(weights_file), framework="pt") as f:
            keys = list(f.keys())
        for key in keys:
            if m := self._PER_EXPERT.search(key):
                proj = self._PROJ.get(m.group(3), m.group(3))
                self.per_expert.setdefault(int(m.group(1)), {})[(int(m.group(2)), proj, m.group(4))] = key
            elif m := self._NATIVE.search(key):
                self.native.setdefault(int(m.group(1)), {})[(m.group(2) or "") + m.group(3)] = key
            else:
                self.ignored.append(
                    key
                )  # attention, shared experts, ...: served by SGLang's own LoRA, not here
        if not self.native and not self.per_expert:
            raise AdapterError(
                f"{weights_file}: no routed-expert adapters (keys like ...experts.lora_A.weight)"
            )

    @property
    def layers(self) -> list[int]:
        return sorted(set(self.native) | set(self.per_expert))

    def _pattern(self, key: str, default, module_name: str):
        value = self.config.get(default[0], default[1])
        for pattern, v in (self.config.get(key) or {}).items():
            if re.search(pattern, module_name) or module_name.endswith(pattern):
                value = v
        return value

    def _rank(self, module_name: str) -> int:
        return int(self._pattern("rank_pattern", ("r", 8), module_name))

    def _scale(self, module_name: str, r: int) -> float:
        alpha = self._pattern("alpha_pattern", ("lora_alpha", 8), module_name)
        return alpha / math.sqrt(r) if self.config.get("use_rslora") else alpha / r

    def _read(self, key: str) -> torch.Tensor:
        with safe_open(str(self._file), framework="pt") as f:
            return f.get_tensor(key).float()

    def _native_pair(self, keys: dict[str, str], which: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(A, B) of the wrapped parameter: gate_up_proj is the inner one ("base_layer.") when both are."""
        targets = self.config.get("target_parameters") or []
        both = "base_layer.A" in keys
        if both:
            prefix = "base_layer." if which == "gate_up" else ""
        else:
            only = "gate_up" if any(t.endswith("gate_up_proj") for t in targets) else "down"
            if which != only:
                return None
            prefix = ""
        if prefix + "A" not in keys or prefix + "B" not in keys:
            return None
        return self._read(keys[prefix + "A"]), self._read(keys[prefix + "B"])

    def deltas(
        self, layer: int, experts: list[int], num_experts: int, hidden: int, intermediate: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """scale * B A of gate ``[n, I, H]``, up ``[n, I, H]`` and down ``[n, H, I]`` for the experts
        named (float32), or None when the adapter has nothing for this layer."""
        n, I, H = len(experts), intermediate, hidden
        d_gate, d_up, d_down = torch.zeros(n, I, H), torch.zeros(n, I, H), torch.zeros(n, H, I)
        where = f"{self._file}, layer {layer}"
        if layer in self.native:
            keys = self.native[layer]
            for which in ("gate_up", "down"):
                pair = self._native_pair(keys, which)
                if pair is None:
                    continue
                a, b = pair
                out, inp = (2 * I, H) if which == "gate_up" else (H, I)
                r = self._rank(f"experts.{which}_proj")
                if tuple(a.shape) != (num_experts * r, inp) or tuple(b.shape) != (out, r * num_experts):
                    raise AdapterError(
                        f"{where}: {which}_proj adapter has A {tuple(a.shape)}, B {tuple(b.shape)}; this "
                        f"model's {num_experts} experts need A [{num_experts} * r, {inp}], "
                        f"B [{out}, r * {num_experts}] with r = {r} ({CONFIG})"
                    )
                s = self._scale(f"experts.{which}_proj", r)
                a_e, b_e = a.reshape(num_experts, r, inp), _deinterleave(b, num_experts)
                for i, e in enumerate(experts):
                    delta = s * (b_e[e] @ a_e[e])
                    if which == "gate_up":
                        d_gate[i] += delta[:I]
                        d_up[i] += delta[I:]
                    else:
                        d_down[i] += delta
        if layer in self.per_expert:
            keys = self.per_expert[layer]
            targets = {"gate_proj": (d_gate, I, H), "up_proj": (d_up, I, H), "down_proj": (d_down, H, I)}
            for i, e in enumerate(experts):
                for proj, (dst, out, inp) in targets.items():
                    if (e, proj, "A") not in keys:
                        continue
                    a, b = self._read(keys[(e, proj, "A")]), self._read(keys[(e, proj, "B")])
                    if a.shape[1] != inp or b.shape[0] != out or a.shape[0] != b.shape[1]:
                        raise AdapterError(
                            f"{where}: expert {e} {proj} adapter has A {tuple(a.shape)}, B {tuple(b.shape)}; "
                            f"the model needs A [r, {inp}], B [{out}, r]"
                        )
                    dst[i] += self._scale(f"experts.{e}.{proj}", a.shape[0]) * (b @ a)
        if layer not in self.native and layer not in self.per_expert:
            return None
        return d_gate, d_up, d_down

    def expert_lora(self, layer: int, num_experts: int, hidden: int, intermediate: int) -> ExpertLoRA:
        """The layer's separate gate / up / down adapters, as ``save_adapter`` wrote them (for resuming
        training); an adapter whose gate and up share A (PEFT's own) has no such split."""
        keys = self.native.get(layer)
        if keys is None:
            raise AdapterError(f"{self._file}: no fused-expert adapter for layer {layer}")
        E, I, H = num_experts, intermediate, hidden
        (gu_a, gu_b), (d_a, d_b) = self._native_pair(keys, "gate_up"), self._native_pair(keys, "down")
        r2 = gu_a.shape[0] // E
        if r2 % 2:
            raise AdapterError(
                f"{self._file}: layer {layer}'s gate_up adapter has odd rank {r2}: not a gate/up pair"
            )
        r = r2 // 2
        gu_a, gu_b = gu_a.reshape(E, r2, H), _deinterleave(gu_b, E)
        off = gu_b[:, :I, r:].abs().max().item() + gu_b[:, I:, :r].abs().max().item()
        if off != 0.0:
            raise AdapterError(
                f"{self._file}: layer {layer}'s gate and up share their A (PEFT's own layout): it merges for "
                "serving but cannot be split into kt-sglang's separate gate and up adapters"
            )
        parts = (
            gu_a[:, :r],
            gu_b[:, :I, :r],
            gu_a[:, r:],
            gu_b[:, I:, r:],
            d_a.reshape(E, r, I),
            _deinterleave(d_b, E),
        )
        return ExpertLoRA(*(t.contiguous() for t in parts), scale=self._scale("experts.down_proj", r))
