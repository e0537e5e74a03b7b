"""The asynchronous runner: ordering, sync semantics, errors surfacing at sync."""

from __future__ import annotations

import os
import threading

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
