"""The stream-signal protocol between a CUDA stream and the engine, with a thread in the stream's part.

On a GPU the stream writes the `ready` word of pinned memory after the input copies
(cuStreamWriteValue32), waits until the engine's forward sets `done` (cuStreamWaitValue32) and clears
it, then copies the output; a CUDA graph replays the same constant values every step. Here a Python
thread does exactly that on the same words, replaying a fixed list of operations as a graph would,
beside a busy process taking a core: every step's output must be the direct forward's, every
wake-up must start exactly one forward, and none may be lost (a lost one hangs the stand-in: it
fails after a deadline instead).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from conftest import make_hidden, make_routing, make_weights

from kt_sglang import KTMoEWrapper
from kt_sglang.engine.buffers import HostBuffers
from kt_sglang.engine.native import _native

READY, DONE = _native.StreamForward.READY, _native.StreamForward.DONE
E, K, H, I = 4, 2, 64, 32


def _layer() -> KTMoEWrapper:
    gate, up, down = make_weights(E, I, H)
    layer = KTMoEWrapper(0, E, K, H, I, None, 1, 1, method="BF16")
    layer.load_weights_from_tensors(gate.bfloat16(), up.bfloat16(), down.bfloat16())
    return layer


class Channel:
    """One StreamForward over buffers of its own, armed for the signal thread, and its inputs."""

    def __init__(self, layer: KTMoEWrapper, tokens: int, seed: int) -> None:
        self.buf = HostBuffers.allocate(tokens, H, K, torch.bfloat16)
        self.forward = layer._stream_forward(self.buf)
        self.forward.arm()
        self.words = self.buf.signal.numpy()
        self.out = self.buf.out.view(torch.int16).numpy()
        hidden = make_hidden(tokens, H, seed=seed)
        ids, weights = make_routing(tokens, E, K, seed=seed)
        self.want = layer.forward(hidden, ids, weights).view(torch.int16).numpy().copy()
        self.buf.hidden.copy_(hidden)
        self.buf.ids.copy_(ids)
        self.buf.weights.copy_(weights)
        self.buf.tokens.fill_(tokens)


def wait_word(words: np.ndarray, index: int, value: int, deadline_s: float, what: str) -> None:
    """The stream's wait, giving the core away at each look (a GPU waits without a core)."""
    end = time.monotonic() + deadline_s
    spins = 0
    while words[index] != value:
        time.sleep(0)
        spins += 1
        if spins % 256 == 0 and time.monotonic() > end:
            raise TimeoutError(f"{what}: word {index} never became {value} (a lost wake-up)")


def replay(ops: list[tuple], steps: int) -> None:
    """Runs ``ops`` ``steps`` times, as a CUDA graph replays its nodes: ("write", ch, word, value),
    ("wait", ch, word, value), ("check", ch)."""
    for step in range(steps):
        for op in ops:
            if op[0] == "write":
                op[1].words[op[2]] = op[3]
            elif op[0] == "wait":
                wait_word(op[1].words, op[2], op[3], 30.0, f"step {step}")
            elif not np.array_equal(op[1].out, op[1].want):
                raise AssertionError(f"step {step}: the output read after `done` is not the forward's")


def assert_forwards(ch: Channel, steps: int) -> None:
    """The signal thread counts a forward when it collects it, a moment after `done` is set."""
    end = time.monotonic() + 10
    while ch.forward.signalled_forwards < steps and time.monotonic() < end:
        time.sleep(0.001)
    assert ch.forward.signalled_forwards == steps


def submit(ch: Channel) -> list[tuple]:
    return [("write", ch, READY, 1)]


def sync(ch: Channel) -> list[tuple]:
    return [("wait", ch, DONE, 1), ("write", ch, DONE, 0), ("check", ch)]


@pytest.fixture
def busy_core():
    """The contention test's busy process: a spinning process on one of the cores."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield
    proc.kill()
    proc.wait()


def run_in_thread(fn, timeout_s: float) -> None:
    errors = []

    def body():
        try:
            fn()
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    t = threading.Thread(target=body, name="stream-stand-in")
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"the stand-in stream did not finish in {timeout_s} s"
    if errors:
        raise errors[0]


def test_one_layer_100k_steps_beside_a_busy_process(busy_core):
    """100,000 replays of submit -> sync on one layer's words: each output right, one forward each."""
    layer = _layer()
    ch = Channel(layer, 1, seed=1)
    before = _native.signal_thread_stats()["forwards"]
    steps = 100_000
    run_in_thread(lambda: replay(submit(ch) + sync(ch), steps), timeout_s=900)
    assert_forwards(ch, steps)
    assert _native.signal_thread_stats()["forwards"] - before >= steps
    ch.forward.check()


def test_deferred_task_spans_the_next_layer(busy_core):
    """A model's order with deferral: layer 0's immediate and deferred tasks submitted, its immediate
    one synced, layer 1 submitted and synced, then layer 0's deferred one synced: the deferred
    task's wait never blocks the others, and every output is right."""
    layer = _layer()
    now0, deferred0, now1 = Channel(layer, 1, seed=2), Channel(layer, 3, seed=3), Channel(layer, 2, seed=4)
    ops = submit(now0) + submit(deferred0) + sync(now0) + submit(now1) + sync(now1) + sync(deferred0)
    steps = 20_000
    run_in_thread(lambda: replay(ops, steps), timeout_s=600)
    for ch in (now0, deferred0, now1):
        assert_forwards(ch, steps)
        ch.forward.check()


def test_a_failed_forward_still_sets_done_and_is_reported():
    """A batch size over the buffers' capacity (read when the task runs): the stream is released
    (`done` set) and check() names the problem."""
    layer = _layer()
    ch = Channel(layer, 2, seed=5)
    ch.buf.tokens.fill_(7)
    run_in_thread(
        lambda: replay([("write", ch, READY, 1), ("wait", ch, DONE, 1), ("write", ch, DONE, 0)], 1), 60
    )
    with pytest.raises(ValueError, match="batch size read at run time is 7"):
        ch.forward.check()


def test_disarmed_on_release():
    """A StreamForward freed with its buffers leaves the signal thread's list."""
    layer = _layer()
    armed = _native.signal_thread_stats()["armed"]
    ch = Channel(layer, 1, seed=6)
    assert _native.signal_thread_stats()["armed"] == armed + 1
    ch.buf.stream_forward = None
    del ch
    assert _native.signal_thread_stats()["armed"] == armed


def test_signal_mode_matches_the_machine(tmp_path):
    """memops where the driver has the stream memory operations (KT_SGLANG_STREAM_SIGNAL=host
    forces host functions), host functions with an older driver, none without a driver."""
    mode = _native.stream_signal()
    status = _native.stream_signal_status()
    assert status.startswith(mode), status
    if not _native.cuda_host_launch_available():
        assert mode == "none"
    code = "from kt_sglang.engine.native import _native; print(_native.stream_signal())"
    for asked in ("host", "memops"):
        r = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env={**os.environ, "KT_SGLANG_STREAM_SIGNAL": asked},
            timeout=120,
            cwd=tmp_path,  # the source tree must not shadow the built package
        )
        assert r.returncode == 0, r.stderr
        got = r.stdout.strip()
        if mode == "none":
            assert got == "none"
        else:
            assert got == ("host-functions" if asked == "host" else mode)
