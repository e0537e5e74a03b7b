"""The process-wide worker pools: every layer of a process shares one native runner."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kt_sglang.engine.native import _native


@dataclass(frozen=True)
class PoolLayout:
    """`threads` workers split over pools; pool p runs on NUMA node `nodes[p]`."""

    threads: int
    nodes: tuple[int, ...]
    cpus: tuple[tuple[int, ...], ...]  # per pool, one OS cpu per worker

    @property
    def pools(self) -> int:
        return len(self.nodes)


def machine_nodes() -> list[dict]:
    return _native.topology()["nodes"]


def physical_cores() -> int:
    return sum(len(n["cores"]) for n in machine_nodes())


def reserved_cores() -> int:
    """Cores the engine leaves to the serving process's own threads: a quarter, at least one.

    Those threads are the CUDA callback thread that starts the engine's stream-ordered tasks, the thread
    that launches kernels and waits in `synchronize`, SGLang's scheduler and tokenizer, and on the CPU
    device torch's threads (attention, hot experts). An engine on every core fights them for it: on an
    H100 host with 16 cores the hybrid step ran 14-25x slower with 16 engine threads than with 12 (steps
    on ~4 ms scheduler ticks), and on a 2-core host `kt-sglang demo` served 43.5-47.8 tokens/s with one
    engine thread against 28.3-35.1 with two."""
    return max(1, physical_cores() // 4)


def serving_threads() -> int:
    """The default engine threads when serving (the plugin, `serve`, `demo`, the hybrid benchmark)."""
    return max(1, physical_cores() - reserved_cores())


def check_thread_count(threads: object, name: str = "cpuinfer_threads") -> int:
    """The one rule for a count of engine threads (the layer, --kt-cpuinfer, the converter): 1..cores."""
    cores = physical_cores()
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= cores:
        raise ValueError(
            f"{name} {threads!r}: this machine has {cores} physical cores; use 1..{cores} "
            "(threads beyond the cores only contend)"
        )
    return threads


def plan_pools(threads: int, pools: int, numa_nodes: list[int] | None = None) -> PoolLayout:
    """Checks the thread and pool counts against the machine and places workers on cores.

    `numa_nodes` names the node of each pool; it is how several pools share one node
    (e.g. ``[0, 0]``). Without it, pool p takes the p-th NUMA node.
    """
    nodes = machine_nodes()
    by_index = {n["os_index"]: n for n in nodes}
    check_thread_count(threads)
    if not isinstance(pools, int) or pools < 1:
        raise ValueError(f"threadpool_count must be a positive integer, got {pools!r}")
    if threads < pools:
        raise ValueError(f"threadpool_count={pools} needs at least one thread per pool, got {threads}")
    if numa_nodes is None:
        if pools > len(nodes):
            raise ValueError(
                f"threadpool_count={pools} is more than the {len(nodes)} NUMA node(s) of this machine; "
                f"use threadpool_count<={len(nodes)}, or pass numa_nodes (e.g. "
                f"numa_nodes={[nodes[0]['os_index']] * pools}) to run several pools on one node"
            )
        numa_nodes = [n["os_index"] for n in nodes[:pools]]
    numa_nodes = [int(n) for n in numa_nodes]
    if len(numa_nodes) != pools:
        raise ValueError(f"numa_nodes has {len(numa_nodes)} entries; threadpool_count is {pools}")
    for n in numa_nodes:
        if n not in by_index:
            raise ValueError(f"numa_nodes names node {n}; this machine has {sorted(by_index)}")
    # Threads per pool, then cores: pools on the same node take distinct cores.
    per_pool = [threads // pools + (1 if p < threads % pools else 0) for p in range(pools)]
    next_core = {n: 0 for n in by_index}
    cpus = []
    for p, node in enumerate(numa_nodes):
        free = by_index[node]["cores"][next_core[node] :]
        if len(free) < per_pool[p]:
            raise ValueError(
                f"NUMA node {node} has {len(by_index[node]['cores'])} cores; the pools placed on it "
                f"need more ({per_pool[p]} for pool {p} after the others)"
            )
        cpus.append(tuple(free[: per_pool[p]]))
        next_core[node] += per_pool[p]
    return PoolLayout(threads, tuple(numa_nodes), tuple(cpus))


class SharedRunner:
    """One native runner (and its scratch) per process, created by the first layer."""

    _lock = threading.Lock()
    _layout: PoolLayout | None = None
    _runner = None
    _workspace = None

    @classmethod
    def get(cls, layout: PoolLayout):
        with cls._lock:
            if cls._runner is None:
                cls._runner = _native.Runner(
                    [(n, list(c)) for n, c in zip(layout.nodes, layout.cpus, strict=True)]
                )
                cls._workspace = _native.Workspace()
                cls._layout = layout
            elif layout != cls._layout:
                old = cls._layout
                raise ValueError(
                    "all layers of a process share one set of pools, already started with "
                    f"cpuinfer_threads={old.threads}, threadpool_count={old.pools}, numa_nodes="
                    f"{list(old.nodes)}; this layer asks for cpuinfer_threads={layout.threads}, "
                    f"threadpool_count={layout.pools}, numa_nodes={list(layout.nodes)}"
                )
            return cls._runner, cls._workspace

    @classmethod
    def current(cls) -> PoolLayout | None:
        """The layout of the process's pools, None before the first layer starts them."""
        with cls._lock:
            return cls._layout

    @classmethod
    def reset(cls) -> None:
        """Forgets the shared runner: the next layer starts new pools (layers built before keep theirs)."""
        with cls._lock:
            cls._runner = cls._workspace = cls._layout = None


ISA_PATHS: tuple[str, ...] = tuple(_native.isa_paths())


def selected_isa(isa: str | None = None) -> str:
    """The kernel family to use: `isa`, else KT_SGLANG_ISA, else the best this CPU runs."""
    if isa is None:
        return _native.selected_isa()  # raises ValueError naming KT_SGLANG_ISA when it is bad
    supported = _native.supported_isas()
    if isa not in ISA_PATHS:
        raise ValueError(f"isa={isa!r} is not an ISA path: use one of {', '.join(ISA_PATHS)}")
    if isa not in supported:
        raise ValueError(f"isa={isa!r} is not supported by this CPU (it runs {supported})")
    return isa
