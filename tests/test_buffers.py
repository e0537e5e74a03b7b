"""Host buffers: captured batch sizes get their own, nothing is reallocated for a known size."""

from __future__ import annotations

from conftest import make_hidden, make_routing, make_weights

from kt_sglang import KTMoEWrapper


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
            layer.forward(make_hidden(T, H), *make_routing(T, E, k))
        assert {b: layer._sets[False].by_size[b].hidden.data_ptr() for b in (1, 2, 4)} == ptrs
        assert layer._sets[False].spare is None  # 3 used the captured 4
        layer.forward(make_hidden(9, H), *make_routing(9, E, k))
        spare = layer._sets[False].spare.hidden.data_ptr()
        layer.forward(make_hidden(7, H), *make_routing(7, E, k))
        assert layer._sets[False].spare.hidden.data_ptr() == spare  # one reusable buffer for other sizes
    finally:
        KTMoEWrapper.clear_buffer_cache()
        KTMoEWrapper.set_capture_batch_sizes([])
    assert all(b.by_size == {} and b.spare is None for b in layer._sets.values())
