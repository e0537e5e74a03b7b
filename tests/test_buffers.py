"""Host buffers: captured batch sizes get their own, nothing is reallocated for a known size."""

from __future__ import annotations

import pytest
import torch
from conftest import make_hidden, make_routing, make_weights

from kt_sglang import KTMoEWrapper
from kt_sglang.engine.native import _native


def _staged_forward(layer: KTMoEWrapper, T: int) -> None:
    """submit/sync copy through the batch-size buffers (forward on host tensors reads in place); both
    give the same output."""
    hidden = make_hidden(T, layer.hidden_size)
    ids, weights = make_routing(T, layer.num_experts, layer.num_experts_per_tok)
    layer.submit_forward(hidden, ids, weights)
    assert torch.equal(layer.sync_forward(hidden), layer.forward(hidden, ids, weights))


def test_capture_sizes_and_reuse():
    E, k, H, I = 8, 2, 256, 192
    gate, up, down = make_weights(E, I, H)
    layer = KTMoEWrapper(0, E, k, H, I, None, 2, 1, method="BF16")
    layer.load_weights_from_tensors(gate.bfloat16(), up.bfloat16(), down.bfloat16())
    KTMoEWrapper.set_capture_batch_sizes([4, 1, 2, 4])
    try:
        assert KTMoEWrapper.get_capture_batch_sizes() == [1, 2, 4]
        assert sorted(layer._sets[False].by_size) == [1, 2, 4]
        ptrs = {b: layer._sets[False].by_size[b].hidden.data_ptr() for b in (1, 2, 4)}
        for T in (1, 2, 3, 4, 1):
            _staged_forward(layer, T)
        assert {b: layer._sets[False].by_size[b].hidden.data_ptr() for b in (1, 2, 4)} == ptrs
        assert layer._sets[False].spare is None  # 3 used the captured 4
        _staged_forward(layer, 9)
        spare = layer._sets[False].spare.hidden.data_ptr()
        _staged_forward(layer, 7)
        assert layer._sets[False].spare.hidden.data_ptr() == spare  # one reusable buffer for other sizes
    finally:
        KTMoEWrapper.clear_buffer_cache()
        KTMoEWrapper.set_capture_batch_sizes([])
    assert all(b.by_size == {} and b.spare is None for b in layer._sets.values())


def _bf16_layer(E=8, k=2, H=256, I=192):
    gate, up, down = make_weights(E, I, H)
    layer = KTMoEWrapper(0, E, k, H, I, None, 2, 1, method="BF16")
    layer.load_weights_from_tensors(gate.bfloat16(), up.bfloat16(), down.bfloat16())
    return layer


def test_stream_ordered_path_equals_direct_forward():
    """submit/sync through the stream-ordered path (with CPU tensors its host functions run at once)
    give the direct forward's output, both submission streams."""
    layer = _bf16_layer()
    for T in (1, 5, 16):
        hidden, (ids, weights) = make_hidden(T, 256), make_routing(T, 8, 2, seed=T)
        want = layer.forward(hidden, ids, weights)
        for deferred in (False, True):
            layer.submit_forward(hidden, ids, weights, cuda_stream=0, deferred=deferred)
            got = layer.sync_forward(hidden, cuda_stream=0, deferred=deferred)
            assert torch.equal(got, want), (T, deferred)


def test_stream_ordered_batch_size_is_read_when_the_task_runs():
    """The rows computed follow num_tokens (pinned memory read by the task), not the shapes seen at
    submit: one captured graph serves smaller batches."""
    layer = _bf16_layer()
    KTMoEWrapper.set_capture_batch_sizes([8])
    try:
        hidden, (ids, weights) = make_hidden(8, 256), make_routing(8, 8, 2)
        buf = layer._sets[False].by_size[8]
        buf.out.fill_(7.0)
        layer.submit_forward(
            hidden, ids, weights, cuda_stream=0, num_tokens=torch.tensor([3], dtype=torch.int32)
        )
        got = layer.sync_forward(hidden, cuda_stream=0)
        assert torch.equal(got[:3], layer.forward(hidden[:3], ids[:3], weights[:3]))
        assert bool((got[3:] == 7.0).all())  # rows past the batch size were not touched
        stream_forward = buf.stream_forward
        for T in (8, 2, 8):  # the same native object and buffers every call: nothing allocated per call
            layer.submit_forward(hidden[:T], ids[:T], weights[:T], cuda_stream=0)
            layer.sync_forward(hidden, cuda_stream=0)
        assert buf.stream_forward is stream_forward and layer._sets[False].spare is None
    finally:
        KTMoEWrapper.clear_buffer_cache()
        KTMoEWrapper.set_capture_batch_sizes([])


def test_stream_ordered_errors_are_raised():
    layer = _bf16_layer()
    hidden, (ids, weights) = make_hidden(4, 256), make_routing(4, 8, 2)
    with pytest.raises(ValueError, match="num_tokens must be an int32 tensor"):
        layer.submit_forward(hidden, ids, weights, cuda_stream=0, num_tokens=torch.tensor([4]))
    with pytest.raises(ValueError, match="num_tokens is 5; the batch has 4 rows"):
        layer.submit_forward(hidden, ids, weights, num_tokens=torch.tensor([5], dtype=torch.int32))
    layer.submit_forward(hidden, ids, weights, cuda_stream=0, num_tokens=torch.tensor([9], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"batch size read at run time is 9, outside \[0, 4\]"):
        layer.sync_forward(hidden, cuda_stream=0)
    layer.submit_forward(hidden, ids, weights, cuda_stream=0)
    with pytest.raises(RuntimeError, match="pass the same cuda_stream"):
        layer.sync_forward(hidden)
    got = layer.sync_forward(hidden, cuda_stream=0)  # still pending after the refused sync
    assert torch.equal(got, layer.forward(hidden, ids, weights))


def test_host_functions_on_a_stream_handle():
    """StreamForward given a stream handle: its host functions run on that CUDA stream with a GPU,
    at once without a driver, and a driver without a usable GPU is a clear error."""
    layer = _bf16_layer()
    hidden, (ids, weights) = make_hidden(4, 256), make_routing(4, 8, 2)
    want = layer.forward(hidden, ids, weights)
    buf = layer._sets[False].for_tokens(4)
    for dst, src in ((buf.hidden, hidden), (buf.ids, ids), (buf.weights, weights)):
        dst[:4].copy_(src)
    buf.tokens.fill_(4)
    buf.out.zero_()
    stream_forward = layer._stream_forward(buf)
    stream = torch.cuda.Stream() if torch.cuda.is_available() else None
    if stream is None and _native.cuda_host_launch_available():
        with pytest.raises(RuntimeError, match="cuLaunchHostFunc failed with CUresult"):
            stream_forward.submit(0)  # the legacy stream without a CUDA context
        return
    handle = stream.cuda_stream if stream is not None else 0
    stream_forward.submit(handle)
    stream_forward.sync(handle)
    if stream is not None:
        stream.synchronize()
    assert torch.equal(buf.out[:4], want)


def test_cuda_host_launch_matches_the_machine():
    """The driver's host-function launch is found exactly when a CUDA driver is installed."""
    import ctypes.util

    has_driver = ctypes.util.find_library("cuda") is not None or torch.cuda.is_available()
    assert _native.cuda_host_launch_available() == has_driver, _native.cuda_host_launch_status()
    if not has_driver:
        assert "no CUDA driver" in _native.cuda_host_launch_status()


@pytest.mark.parametrize("method", ["BF16", "AMXINT4"])
def test_fp32_output_is_the_sum_the_bf16_output_rounds(method):
    """output_dtype fp32: the same sums before their one rounding, on the host path and through the
    buffers, with two pools (whose partial sums the combine adds) and a captured size."""
    E, k, H, I = 8, 3, 256, 192
    gate, up, down = make_weights(E, I, H, seed=5)
    layer = KTMoEWrapper(0, E, k, H, I, None, 2, 2, method=method, numa_nodes=[0, 0])
    layer.load_weights_from_tensors(gate.bfloat16(), up.bfloat16(), down.bfloat16())
    hidden = make_hidden(6, H)
    ids, weights = make_routing(6, E, k, seed=6, skip_fraction=0.1)
    rounded = layer.forward(hidden, ids, weights)
    KTMoEWrapper.set_capture_batch_sizes([8])
    try:
        layer.output_dtype = torch.float32
        assert layer._sets[False].by_size[8].out.dtype == torch.float32
        exact = layer.forward(hidden, ids, weights)
        layer.submit_forward(hidden, ids, weights)
        staged = layer.sync_forward(hidden)
    finally:
        KTMoEWrapper.set_capture_batch_sizes([])
        KTMoEWrapper.clear_buffer_cache()
    assert exact.dtype == staged.dtype == torch.float32
    assert torch.equal(staged, exact)
    assert torch.equal(exact.bfloat16(), rounded)
    assert not torch.equal(exact, rounded.float())  # the fp32 sums carry bits bf16 drops
    with pytest.raises(ValueError, match="output_dtype must be torch.bfloat16 or torch.float32"):
        layer.output_dtype = torch.float16
