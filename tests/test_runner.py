"""The asynchronous runner: ordering, sync semantics, errors surfacing at sync."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import make_hidden, make_routing, make_weights

from kt_sglang import KTMoEWrapper
from kt_sglang.engine.native import _native


def build_layers(n, method="AMXINT8", E=16, k=4, H=512, I=256):
    layers = []
    for i in range(n):
        gate, up, down = make_weights(E, I, H, seed=100 + i)
        w = KTMoEWrapper(i, E, k, H, I, None, 2, 1, method=method)
        w.load_weights_from_tensors(gate.bfloat16(), up.bfloat16(), down.bfloat16())
        layers.append(w)
    return layers


def test_back_to_back_equals_one_by_one():
    layers = build_layers(6)
    inputs = [(make_hidden(37, 512, seed=i), *make_routing(37, 16, 4, seed=i)) for i in range(6)]
    one_by_one = [layer.forward(*args) for layer, args in zip(layers, inputs, strict=True)]
    for layer, args in zip(layers, inputs, strict=True):
        layer.submit_forward(*args)
    back_to_back = [layer.sync_forward(args[0]) for layer, args in zip(layers, inputs, strict=True)]
    for a, b in zip(one_by_one, back_to_back, strict=True):
        assert torch.equal(a, b)


def test_sync_allow_pending():
    layers = build_layers(4)
    runner = layers[0]._runner
    for i, layer in enumerate(layers):
        layer.submit_forward(make_hidden(300, 512, seed=i), *make_routing(300, 16, 4, seed=i))
    runner.sync(allow_pending=2)
    assert runner.pending() <= 2
    runner.sync(0)
    assert runner.pending() == 0
    for layer in layers:  # results are there and right after the global sync
        assert layer.sync_forward().shape == (300, 512)


def test_sync_rejects_negative_allow_pending():
    runner = _native.Runner([(0, [0])])
    with pytest.raises(ValueError, match="allow_pending must be >= 0"):
        runner.sync(allow_pending=-1)


def test_callers_on_several_threads_each_wake_at_their_task():
    """Callers waiting for different tasks at once all return (the runner wakes callers only
    when the fewest completions one of them waits for is reached, and each re-arms its own)."""
    layer = build_layers(1)[0]
    runner = layer._runner
    T = 300
    x = make_hidden(T, 512)
    ids, weights = make_routing(T, 16, 4)
    outs = [torch.empty(T, 512, dtype=torch.bfloat16) for _ in range(12)]
    ptrs = (x.data_ptr(), ids.data_ptr(), ids.dtype == torch.int64, weights.data_ptr(), 0)
    task_ids = [layer._layer.submit_forward(T, 0, *ptrs, out.data_ptr(), False) for out in outs]
    returned = []
    # daemon threads: a caller never woken fails the test instead of hanging the process at exit
    callers = [
        threading.Thread(target=lambda i=i: (runner.wait(i), returned.append(i)), daemon=True)
        for i in task_ids[::-1]
    ]
    callers.append(
        threading.Thread(target=lambda: (runner.sync(allow_pending=6), returned.append("sync")), daemon=True)
    )
    for c in callers:
        c.start()
    for c in callers:
        c.join(timeout=60)
    assert not any(c.is_alive() for c in callers), "a caller was never woken"
    assert sorted(returned, key=str) == sorted([*task_ids, "sync"], key=str)
    expected = layer.forward(x, ids, weights)
    for out in outs:
        assert torch.equal(out, expected)


def test_callers_pinned_to_each_cpu_are_woken_and_every_task_counted_once():
    """The worker on the caller's CPU counts each completion and wakes the caller; from every CPU
    (a worker's or not), each task is counted exactly once and results are right."""
    layer = build_layers(1)[0]
    runner = layer._runner
    x = make_hidden(5, 512)
    ids, weights = make_routing(5, 16, 4)
    expected = layer.forward(x, ids, weights)
    outs = [torch.empty(5, 512, dtype=torch.bfloat16) for _ in range(4)]
    ptrs = (x.data_ptr(), ids.data_ptr(), ids.dtype == torch.int64, weights.data_ptr(), 0)
    failures = []

    def calls_from(cpu):
        try:
            os.sched_setaffinity(0, {cpu})  # this thread only
            for _ in range(20):
                if not torch.equal(layer.forward(x, ids, weights), expected):
                    failures.append(f"cpu {cpu}: wrong forward")
                last = [layer._layer.submit_forward(5, 0, *ptrs, o.data_ptr(), False) for o in outs][-1]
                runner.wait(last)
                if runner.pending() != 0:
                    failures.append(f"cpu {cpu}: {runner.pending()} pending after the last task")
        except Exception as e:  # surfaced below
            failures.append(f"cpu {cpu}: {e!r}")

    for cpu in sorted(os.sched_getaffinity(0)):
        caller = threading.Thread(target=calls_from, args=(cpu,), daemon=True)
        caller.start()
        caller.join(timeout=60)
        assert not caller.is_alive(), f"a caller on cpu {cpu} was never woken"
    assert failures == []
    assert all(torch.equal(o, expected) for o in outs)


def test_task_error_surfaces_at_sync_once():
    runner = _native.Runner([(0, [0])])
    runner.submit_failing_task("boom in a task")
    with pytest.raises(RuntimeError, match="boom in a task"):
        runner.sync()
    runner.sync()  # reported once; the runner keeps working


def test_error_does_not_block_later_tasks():
    layers = build_layers(1)
    layer = layers[0]
    x = make_hidden(8, 512)
    ids, weights = make_routing(8, 16, 4)
    expected = layer.forward(x, ids, weights)
    layer._runner.submit_failing_task("first fails")
    layer.submit_forward(x, ids, weights)
    with pytest.raises(RuntimeError, match="first fails"):
        layer.sync_forward(x)
    layer.submit_forward(x, ids, weights)
    assert torch.equal(layer.sync_forward(x), expected)


def test_runner_rejects_empty_pools():
    with pytest.raises(ValueError, match="at least one thread"):
        _native.Runner([(0, [])])


def _cpus_allowed(task: str) -> set[int] | None:
    try:
        with open(f"/proc/self/task/{task}/status") as f:
            text = f.read()
    except FileNotFoundError:  # the thread ended
        return None
    spec = next(line.split()[1] for line in text.splitlines() if line.startswith("Cpus_allowed_list"))
    cpus = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def _one_token_layer(runner):
    """A function that runs one token through a layer on `runner` (Qwen3-30B-A3B's expert shapes, 64
    experts, AMXINT4 groups of 32); the layer lives as long as the function."""
    E, k, H, I = 64, 8, 2048, 768
    gate, up, down = make_weights(E, I, H, seed=5)
    layer = _native.MoeLayer(
        runner, _native.Workspace(), E, k, H, I, _native.Method.AMXINT4, 32, _native.best_isa(), 4
    )
    dense = [t.bfloat16() for t in (gate, up, down)]
    layer.load_dense(*(t.data_ptr() for t in dense), _native.DType.bfloat16, E, [])
    x = make_hidden(1, H)
    out = torch.empty(1, H, dtype=torch.bfloat16)
    routes = [(ids.int(), weights) for ids, weights in (make_routing(1, E, k, seed=s) for s in range(32))]

    def one_token(i: int) -> None:
        ids, weights = routes[i % len(routes)]
        layer.submit_forward(
            1, 0, x.data_ptr(), ids.data_ptr(), False, weights.data_ptr(), 0, out.data_ptr(), False
        )
        runner.sync(0)

    return one_token


TWO_CPUS = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2,
    reason="needs a host with at least 2 CPUs (a one-core pool pulls no worker)",
)


@TWO_CPUS
def test_pulled_workers_return_to_their_pool():
    """A worker waiting long at a barrier moves a late one onto its own core for that barrier only.
    The late one restores its pool's cores when it arrives; a restore that came before the move left
    it bound to the other worker's core for good (both workers of a 2-core pool on one core, decode
    2x slower), about 3 s into back-to-back one-token calls on the 2-core Xeon."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    before = set(os.listdir("/proc/self/task"))
    runner = _native.Runner([(0, cpus)])
    workers = set(os.listdir("/proc/self/task")) - before
    assert len(workers) == 2
    one_token = _one_token_layer(runner)
    for round_ in range(5):
        deadline, i = time.monotonic() + 1.5, 0
        while time.monotonic() < deadline:
            one_token(i)
            i += 1
        time.sleep(0.1)  # every worker past its last barrier, asleep
        bound = {t: _cpus_allowed(t) for t in workers}
        assert all(c == set(cpus) for c in bound.values()), f"round {round_}: worker affinities {bound}"


@TWO_CPUS
def test_a_caller_busy_between_calls_gets_no_pulls():
    """A caller that spends 30 us between one-token calls (allocating its output, as the wrapper
    does) makes one worker a little late at the first barrier; pulled at once, both workers then
    shared one core for the rest of the call (1.6 against 0.8 ms). Only a long wait pulls."""
    runner = _native.Runner([(0, sorted(os.sched_getaffinity(0))[:2])])
    one_token = _one_token_layer(runner)
    calls = 400
    for i in range(calls):
        until = time.perf_counter() + 30e-6
        while time.perf_counter() < until:
            pass
        one_token(i)
    assert runner.pulls() < calls // 10


@TWO_CPUS
def test_a_starved_worker_delays_no_step():
    """Steps open when their units are done, not when every worker has arrived. Worker 1 of two is
    starved (SCHED_IDLE, a busy process on each core: it runs only in the scraps of time no one
    else wants), and one-token calls still go on at worker 0's pace, a few times the median alone
    (4.7x on the 2-core Xeon: worker 0 shares its core with a busy process). Behind all-worker
    barriers every call waited for the starved worker: median 364 ms, 460x."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    before = set(os.listdir("/proc/self/task"))
    runner = _native.Runner([(0, cpus)])
    workers = sorted(set(os.listdir("/proc/self/task")) - before, key=int)
    assert len(workers) == 2
    one_token = _one_token_layer(runner)
    alone = _median_time(one_token, 200)
    code = "import os; os.sched_setaffinity(0, {%d})\nwhile True: pass"
    busy = [subprocess.Popen([sys.executable, "-c", code % cpu]) for cpu in cpus]
    times = []
    try:
        time.sleep(0.2)
        os.sched_setscheduler(int(workers[1]), os.SCHED_IDLE, os.sched_param(0))
        deadline = time.monotonic() + 10
        for i in range(200):
            t = time.perf_counter()
            one_token(i)
            times.append(time.perf_counter() - t)
            if time.monotonic() > deadline:
                break
    finally:
        for b in busy:
            b.kill()
            b.wait()
    starved = statistics.median(times)
    assert starved < 20 * alone, (
        f"{len(times)} calls with worker 1 starved: median {starved * 1e3:.1f} ms, {alone * 1e3:.2f} ms alone"
    )


def _median_time(one_token, calls: int) -> float:
    for i in range(20):
        one_token(i)
    times = []
    for i in range(calls):
        t = time.perf_counter()
        one_token(i)
        times.append(time.perf_counter() - t)
    return statistics.median(times)
