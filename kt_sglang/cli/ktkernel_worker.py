"""Runs kt-kernel's MoE layer for `kt-sglang bench --kt-kernel-python PY`, in kt-kernel's environment.

That environment's interpreter runs this file by path, so it imports only the standard library,
torch and kt_kernel (0.7.2). It calls kt-kernel's engine below its Python wrapper, which needs a
CUDA device; the calls are the ones the wrapper makes (CPUInfer, MOEConfig, load_weights_task,
forward_task). Weights are random N(0, 1/fan_in) like the benchmark's, quantized on load.

Protocol: one JSON request per line on stdin, one JSON reply per line on the original stdout
(kt-kernel's own prints are dropped):
  {"op": "load", "hidden", "intermediate", "experts", "top_k", "method", "threads",
   "working_set_gib", "max_tokens"}                    -> {"copies", "packed_bytes"}
  {"op": "time", "tokens", "calls", "routings", "seed"} -> {"seconds": [...]}
  {"op": "version"}                                   -> {"kt_kernel", "torch"}
  {"op": "exit"}
An error replies {"error": "..."}.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import traceback

import torch

# Bytes per weight of kt-kernel's packed formats (scales are per row: negligible).
PACKED_BYTES_PER_WEIGHT = {"BF16": 2.0, "AMXINT8": 1.0, "AMXINT4": 0.5, "FP8": 1.0, "FP8_PERCHANNEL": 1.0}


def _to_fp8(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 weights and fp32 scales (amax / 448 per 128 x 128 block or per row), as FP8 checkpoints
    ship them."""
    w = w.float()
    if per_channel:
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 448.0
        return (w / scale[:, None]).to(torch.float8_e4m3fn), scale.contiguous()
    N, K = w.shape
    blocks = w.reshape(N // 128, 128, K // 128, 128)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).reshape(N, K).to(torch.float8_e4m3fn)
    return q, scale.contiguous()


class KtKernelLayers:
    """Copies of one layer on kt-kernel's engine, enough to cover the working set."""

    def __init__(self, hidden, intermediate, experts, top_k, method, threads, working_set_gib, max_tokens):
        import kt_kernel  # noqa: F401  (loads the kt_kernel_ext build this CPU runs)
        import kt_kernel_ext
        import kt_kernel_ext.moe as moe

        if method not in PACKED_BYTES_PER_WEIGHT:
            raise ValueError(f"method {method!r} is not one of {sorted(PACKED_BYTES_PER_WEIGHT)}")
        self.H, self.I, self.E, self.k = hidden, intermediate, experts, top_k
        pool = kt_kernel_ext.WorkerPoolConfig()
        pool.subpool_count, pool.subpool_numa_map, pool.subpool_thread_count = 1, [0], [threads]
        self.cpu = kt_kernel_ext.CPUInfer(pool)
        self.mask = torch.zeros(experts, dtype=torch.bool)  # no expert on a GPU
        self.packed_bytes = int(3 * hidden * intermediate * experts * PACKED_BYTES_PER_WEIGHT[method])
        copies = max(1, -(-int(working_set_gib * 2**30) // self.packed_bytes))
        gen = torch.Generator().manual_seed(0)
        gate = torch.empty(experts, intermediate, hidden, dtype=torch.bfloat16)
        up = torch.empty_like(gate)
        down = torch.empty(experts, hidden, intermediate, dtype=torch.bfloat16)
        for e in range(experts):  # one expert at a time: float32 temporaries of a whole layer do not fit
            gate[e] = torch.randn(intermediate, hidden, generator=gen) / hidden**0.5
            up[e] = torch.randn(intermediate, hidden, generator=gen) / hidden**0.5
            down[e] = torch.randn(hidden, intermediate, generator=gen) / intermediate**0.5
        identity = torch.arange(experts, dtype=torch.int64)
        # The quantized methods write their packed files while loading from bf16 ("save" mode).
        scratch = tempfile.mkdtemp(prefix="ktkernel-bench-")
        self.layers = []
        try:
            for c in range(copies):
                config = moe.MOEConfig(experts, top_k, hidden, intermediate, self.mask.data_ptr())
                # max_len sizes its scratch (GBs for DeepSeek at 4096): no larger than the run needs
                config.layer_idx, config.pool, config.max_len = c, self.cpu.backend_, max_tokens
                if method in ("FP8", "FP8_PERCHANNEL"):  # the checkpoint's tensors, per expert
                    per_channel = method == "FP8_PERCHANNEL"
                    fp8 = [[_to_fp8(t, per_channel) for t in proj] for proj in (gate, up, down)]
                    config.gate_projs, config.up_projs, config.down_projs = (
                        [[q.data_ptr() for q, _ in proj]] for proj in fp8
                    )
                    config.gate_scales, config.up_scales, config.down_scales = (
                        [[s.data_ptr() for _, s in proj]] for proj in fp8
                    )
                    config.quant_config.bits = 8
                    config.quant_config.zero_point = False
                    if per_channel:
                        config.quant_config.per_channel = True
                        layer = moe.AMXFP8PerChannel_MOE(config)
                    else:
                        config.quant_config.group_size = 128
                        layer = moe.AMXFP8_MOE(config)
                    self.cpu.submit(layer.load_weights_task(identity.data_ptr()))
                    self.cpu.sync()
                    self.layers.append(layer)
                    del fp8
                    continue
                if method == "BF16":
                    config.gate_projs = [[t.data_ptr() for t in gate]]
                    config.up_projs = [[t.data_ptr() for t in up]]
                    config.down_projs = [[t.data_ptr() for t in down]]
                    config.gate_scales = config.up_scales = config.down_scales = [[0] * experts]
                    layer = moe.AMXBF16_MOE(config)
                else:
                    config.save, config.load, config.path = True, False, scratch
                    config.gate_proj, config.up_proj = gate.data_ptr(), up.data_ptr()
                    config.down_proj = down.data_ptr()
                    layer = (moe.AMXInt8_MOE if method == "AMXINT8" else moe.AMXInt4_MOE)(config)
                self.cpu.submit(layer.load_weights_task(identity.data_ptr()))
                self.cpu.sync()
                self.layers.append(layer)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def time(self, tokens: int, calls: int, routings: int, seed: int) -> list[float]:
        """Seconds per call of `calls` forwards cycling the copies and `routings` random inputs."""
        gen = torch.Generator().manual_seed(seed)
        inputs = []
        for _ in range(routings):
            ids = torch.stack([torch.randperm(self.E, generator=gen)[: self.k] for _ in range(tokens)])
            weights = torch.rand(tokens, self.k, generator=gen)
            hidden = torch.randn(tokens, self.H, generator=gen).bfloat16()
            inputs.append((hidden, ids.contiguous(), (weights / weights.sum(-1, keepdim=True)).contiguous()))
        out = torch.empty(tokens, self.H, dtype=torch.bfloat16)
        batch = torch.tensor([tokens], dtype=torch.int32)
        seconds = []
        for i in range(calls):
            hidden, ids, weights = inputs[i % routings]
            t = time.perf_counter()  # from the task's creation, as kt-kernel's wrapper makes one per call
            task = self.layers[i % len(self.layers)].forward_task(
                batch.data_ptr(),
                self.k,
                ids.data_ptr(),
                weights.data_ptr(),
                hidden.data_ptr(),
                out.data_ptr(),
                False,
            )
            self.cpu.submit(task)
            self.cpu.sync()
            seconds.append(time.perf_counter() - t)
        return seconds


def main() -> None:
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    # kt-kernel prints progress from C++ on stdout: it must not reach the protocol stream.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    layers = None
    for line in sys.stdin:
        request = json.loads(line)
        try:
            op = request.pop("op")
            if op == "exit":
                break
            if op == "version":
                from importlib.metadata import PackageNotFoundError, version

                try:
                    reply = {"kt_kernel": version("kt-kernel"), "torch": torch.__version__}
                except PackageNotFoundError:
                    raise RuntimeError(f"kt-kernel is not installed for {sys.executable}") from None
            elif op == "load":
                layers = None  # frees the previous method's copies first
                layers = KtKernelLayers(**request)
                reply = {"copies": len(layers.layers), "packed_bytes": layers.packed_bytes}
            elif op == "time":
                if layers is None:
                    raise RuntimeError("time before load")
                reply = {"seconds": layers.time(**request)}
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as e:  # the bench reports it and stops the side-by-side run
            if not isinstance(e, (RuntimeError, ValueError)):
                traceback.print_exc()  # unexpected: the whole story on stderr
            reply = {"error": f"{type(e).__name__}: {e}"}
        replies.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
