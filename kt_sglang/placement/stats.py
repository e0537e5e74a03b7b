"""Routing statistics: how often each expert of each MoE layer was selected.

File format (JSON, documented in docs/usage.md)::

    {"format": "kt-sglang-placement-stats", "version": 1, "num_experts": 128,
     "layers": {"0": [count of expert 0, count of expert 1, ...], "1": [...], ...}}

Counts are selections (a token routed to an expert counts 1). Recording merges into an existing
file: a new run's counts are added to those already there. Writes go to a temporary file and are
renamed, so a reader never sees half a file.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

FORMAT = "kt-sglang-placement-stats"
VERSION = 1


@dataclass
class PlacementStats:
    num_experts: int
    layers: dict[int, list[int]] = field(default_factory=dict)

    @classmethod
    def read(cls, path: str | Path) -> PlacementStats:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"placement statistics file {path} does not exist") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"placement statistics file {path} is not valid JSON: {exc}") from None
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise ValueError(f"{path} is not a {FORMAT} v{VERSION} file (format {data.get('format')!r})")
        E = int(data["num_experts"])
        layers = {}
        for key, counts in data["layers"].items():
            if len(counts) != E or any((not isinstance(c, int)) or c < 0 for c in counts):
                raise ValueError(f"{path}: layer {key} must hold {E} non-negative integer counts")
            layers[int(key)] = list(counts)
        return cls(E, layers)

    def counts(self, layer: int, num_experts: int) -> list[int]:
        if num_experts != self.num_experts:
            raise ValueError(
                f"placement statistics are for {self.num_experts} experts per layer; "
                f"the model has {num_experts}"
            )
        return self.layers.get(layer, [0] * num_experts)

    def merged(self, other: PlacementStats) -> PlacementStats:
        if other.num_experts != self.num_experts:
            raise ValueError(f"cannot merge statistics of {other.num_experts} and {self.num_experts} experts")
        layers = {k: list(v) for k, v in self.layers.items()}
        for layer, counts in other.layers.items():
            base = layers.setdefault(layer, [0] * self.num_experts)
            layers[layer] = [a + b for a, b in zip(base, counts, strict=True)]
        return PlacementStats(self.num_experts, layers)

    def write(self, path: str | Path) -> None:
        path = Path(path)
        data = {
            "format": FORMAT,
            "version": VERSION,
            "num_experts": self.num_experts,
            "layers": {str(k): v for k, v in sorted(self.layers.items())},
        }
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)


class StatsRecorder:
    """Counts routed selections per layer while serving and merges them into ``path``.

    The file is rewritten at most every ``interval_s`` seconds (default: KT_SGLANG_STATS_INTERVAL_S,
    else 5) and at exit, as the counts already in
    the file when recording started plus everything counted since.
    """

    def __init__(self, path: str | Path, num_experts: int, interval_s: float | None = None) -> None:
        self.path = Path(path)
        self.num_experts = num_experts
        if interval_s is None:
            raw = os.environ.get("KT_SGLANG_STATS_INTERVAL_S", "") or "5"
            try:
                interval_s = float(raw)
            except ValueError:
                interval_s = -1.0
            if not interval_s >= 0:  # 0: rewrite the file at every step
                raise ValueError(f"KT_SGLANG_STATS_INTERVAL_S={raw!r} is not a number of seconds (0 or more)")
        self.interval_s = interval_s
        self._base = PlacementStats.read(self.path) if self.path.exists() else PlacementStats(num_experts)
        self._base.counts(0, num_experts)  # the same expert count, or a clear error
        self._counts: dict[int, torch.Tensor] = {}
        self._last_write = time.monotonic()
        self._lock = threading.Lock()
        atexit.register(self.flush)

    def add(self, layer: int, topk_ids: torch.Tensor) -> None:
        ids = topk_ids.reshape(-1)
        ids = ids[ids >= 0].long()
        counts = torch.bincount(ids, minlength=self.num_experts)
        if layer in self._counts:
            self._counts[layer] += counts
        else:
            self._counts[layer] = counts
        if time.monotonic() - self._last_write >= self.interval_s:
            self.flush()

    def snapshot(self) -> PlacementStats:
        now = PlacementStats(self.num_experts, {layer: c.cpu().tolist() for layer, c in self._counts.items()})
        return self._base.merged(now)

    def flush(self) -> None:
        with self._lock:
            self.snapshot().write(self.path)
            self._last_write = time.monotonic()
