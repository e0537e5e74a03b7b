"""How a CUDA stream hands a layer to the engine and waits for it (docs/hybrid-layer.md).

The engine picks the driver's stream memory operations when it has them (``memops``), host functions
otherwise. Before the first layer uses them on a GPU, they are tried once on the device, eagerly and
under CUDA graph capture; if either fails, every stream uses host functions instead, said in one
log line and by ``kt-sglang doctor``.
"""

from __future__ import annotations

import logging

import torch

from kt_sglang.engine.native import _native

logger = logging.getLogger(__name__)

_probed = False


def stream_signal() -> str:
    """The mode in use: ``memops``, ``host-functions`` or ``none`` (no CUDA driver); on a GPU the
    memory operations are probed first (once per process, never during a graph capture)."""
    global _probed
    if (
        not _probed
        and _native.stream_signal() == "memops"
        and torch.cuda.is_available()
        and not torch.cuda.is_current_stream_capturing()
    ):
        _probed = True
        try:
            _probe_memory_operations()
        except Exception as exc:  # any failure: the fallback works wherever CUDA does
            _native.stream_signal_fall_back(f"{type(exc).__name__}: {exc}")
            logger.warning("kt-sglang: %s", _native.stream_signal_status())
    return _native.stream_signal()


def _probe_memory_operations() -> None:
    """A write, a wait for it and a second write on a side stream, eagerly and replayed from a
    captured graph: the second write must reach pinned host memory both times."""
    words = torch.zeros(_native.StreamForward.SIGNAL_WORDS, dtype=torch.int32).pin_memory()
    ready = _native.host_device_pointer(words.data_ptr())
    done = ready + 4 * _native.StreamForward.DONE

    def handover() -> None:
        stream = torch.cuda.current_stream().cuda_stream
        _native.stream_write_value32(stream, ready, 1)
        _native.stream_wait_value32(stream, ready, 1)
        _native.stream_write_value32(stream, done, 7)

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        handover()
    side.synchronize()
    if int(words[_native.StreamForward.DONE]) != 7:
        raise RuntimeError("a stream's write did not reach pinned host memory")
    words.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        handover()
    graph.replay()
    torch.cuda.synchronize()
    if int(words[_native.StreamForward.DONE]) != 7:
        raise RuntimeError("a captured graph's write did not reach pinned host memory")
