"""`kt-sglang version` and `kt-sglang doctor`."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys

from kt_sglang import __version__


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def print_version() -> None:
    from kt_sglang.engine.native import _native

    print(f"kt-sglang {__version__}")
    print(
        f"python {platform.python_version()}, torch {_package_version('torch') or 'missing'}, "
        f"sglang {_package_version('sglang') or 'not installed'}"
    )
    print(f"kernel paths: {', '.join(_native.supported_isas())} (chosen: {_native.best_isa()})")


SGLANG_VERSION = "0.5.23"  # the version pyproject.toml pins


def _memory_bytes() -> tuple[int, int]:
    """(total, available) RAM from /proc/meminfo."""
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    return info["MemTotal"], info.get("MemAvailable", info["MemFree"])


def _check_model(model: str, method: str, available: int, problems: list[str], advice: list[str]) -> None:
    """What serving the weights at ``model`` with ``method`` (or the method they record) needs in RAM,
    and converting them on disk."""
    import shutil
    from pathlib import Path

    from kt_sglang.engine.methods import parse_method, resolve_group
    from kt_sglang.engine.weight_source import open_source
    from kt_sglang.weights.canonical_files import expert_bytes, format_size

    try:
        source = open_source(model)
        recorded = source.recorded_method()
        m = parse_method(recorded or method)
        source.check_method(m, "--kt-method")
        shape = source.shape()
        group = resolve_group(m, source.recorded_group(m))
    except ValueError as exc:
        problems.append(str(exc))
        return
    one = expert_bytes(m, group, shape.hidden_size, shape.intermediate_size)
    experts = len(shape.moe_layers) * shape.num_experts * one
    print(
        f"model {model}: {len(shape.moe_layers)} MoE layers x {shape.num_experts} experts; as {m.value} the "
        f"CPU experts take {format_size(experts)} of RAM ({available / 2**30:.1f} GiB available)"
    )
    if experts > available:
        problems.append(
            f"the experts need {format_size(experts)} as {m.value}; {available / 2**30:.1f} GiB are "
            "available: a smaller method (AMXINT4) or more memory"
        )
    if recorded is not None:  # converted already
        return
    free = shutil.disk_usage(Path(model).resolve().parent).free
    print(
        f"  converting it (kt-sglang convert-cpu) writes {format_size(experts)}, twice that while "
        f"merging; {free / 2**30:.1f} GiB free next to the model"
    )
    if 2 * experts > free:
        advice.append(
            "not enough free disk next to the model to convert it there (or use --no-merge-safetensor)"
        )


def run_doctor(model: str | None = None, method: str = "AMXINT4") -> int:
    """Prints what this machine offers the engine and what to fix; 1 when something blocks it.
    With ``model`` (a local checkpoint, or any weight source), also what serving and converting it
    need."""
    from kt_sglang.engine.native import _native

    problems: list[str] = []
    advice: list[str] = []
    f = _native.cpu_features()
    print(f"kt-sglang {__version__}")
    print(f"CPU: {f['brand'] or 'unknown'}")
    flags = [
        name
        for name in (
            "avx2",
            "fma",
            "f16c",
            "avx512f",
            "avx512bw",
            "avx512vl",
            "avx512_vnni",
            "avx512_bf16",
            "avx512_vbmi",
            "amx_tile",
            "amx_int8",
            "amx_bf16",
        )
        if f[name]
    ]
    print(f"  CPUID: {' '.join(flags) or 'none of the SIMD extensions used here'}")
    supported = _native.supported_isas()
    print(f"  kernel paths this build can run here: {', '.join(supported)}")
    try:
        chosen = _native.selected_isa()
        print(
            f"  chosen path: {chosen}"
            + (" (forced by KT_SGLANG_ISA)" if os.environ.get("KT_SGLANG_ISA") else "")
        )
        for name, family in _native.kernel_families(chosen).items():
            print(f"    {name} -> {family} kernels")
    except ValueError as exc:
        problems.append(str(exc))
        chosen = None
    try:
        ahead = _native.weight_prefetch_bytes()
        forced = os.environ.get("KT_SGLANG_PREFETCH_BYTES")
        why = "KT_SGLANG_PREFETCH_BYTES" if forced else f"default for {f['vendor'] or 'this CPU'}"
        print(
            "  decode weight prefetch: "
            + (f"{ahead} bytes ahead" if ahead else "off (hardware prefetcher only)")
            + f" ({why})"
        )
    except ValueError as exc:
        problems.append(str(exc))
    if f["amx_tile"]:
        if f["amx_permitted"]:
            print("  AMX: available, permission granted by the kernel")
        else:
            problems.append(f"AMX present but not usable: {f['amx_permission_error']}")
            advice.append("AMX needs Linux >= 5.16 with XFD; the engine runs on AVX-512 meanwhile")
    else:
        print("  AMX: not on this CPU (AVX-512 / AVX2 kernels are used; prefill is slower)")
    if "avx2" not in supported:
        advice.append("this CPU has no AVX2: only the portable scalar kernels run (slow)")

    topo = _native.topology()
    print(
        f"NUMA (hwloc {topo['hwloc_version']}): {len(topo['nodes'])} node(s), "
        f"memory binding {'supported' if topo['membind_supported'] else 'not supported'}"
    )
    for node in topo["nodes"]:
        gib = node["memory_bytes"] / 2**30
        print(f"  node {node['os_index']}: {len(node['cores'])} cores (cpus {node['cores']}), {gib:.1f} GiB")
    from kt_sglang.engine.pools import reserved_cores, serving_threads

    print(
        f"  suggested: --kt-cpuinfer {serving_threads()} --kt-threadpool-count {len(topo['nodes'])} "
        f"({reserved_cores()} core(s) left to SGLang's scheduler, the CUDA callback and launching threads)"
    )
    total, available = _memory_bytes()
    print(f"RAM: {total / 2**30:.1f} GiB, {available / 2**30:.1f} GiB available")
    if model is not None:
        _check_model(model, method, available, problems, advice)

    print(f"Python {platform.python_version()} ({sys.executable})")
    torch_version = _package_version("torch")
    print(f"torch {torch_version or 'missing'}")
    if not torch_version:
        problems.append("torch is not installed: pip install torch")
    sglang_version = _package_version("sglang")
    print(f"sglang {sglang_version or 'not installed'}")
    if not sglang_version:
        advice.append("serving needs SGLang: pip install 'kt-sglang[sglang]' (Python 3.11 to 3.13)")
    elif sglang_version != SGLANG_VERSION:
        problems.append(
            f"sglang {sglang_version} is installed; the plugin is built and tested for {SGLANG_VERSION}: "
            f"pip install sglang=={SGLANG_VERSION}"
        )
    plugins = os.environ.get("SGLANG_PLUGINS")
    if plugins is not None and "kt_sglang" not in [p.strip() for p in plugins.split(",")]:
        problems.append(
            f"SGLANG_PLUGINS={plugins!r} leaves kt_sglang out: SGLang will not load the plugin "
            "(add kt_sglang to the list, or unset it)"
        )
    try:
        import torch

        if torch.cuda.is_available():
            names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            print(f"GPU: {', '.join(names)}")
            if not _native.cuda_host_launch_available():
                problems.append(
                    f"CUDA works but the engine cannot order its work on CUDA streams: "
                    f"{_native.cuda_host_launch_status()}"
                )
        else:
            print("GPU: none (CPU-only serving: hot experts run on the CPU device too)")
    except Exception as exc:  # a broken CUDA install should not hide the rest of the report
        advice.append(f"torch could not query CUDA: {exc}")
    if _native.cuda_host_launch_available():
        print("CUDA driver: found")
    else:
        print(f"CUDA driver: {_native.cuda_host_launch_status()}")
    # How a CUDA stream hands a layer to the engine and waits for it (docs/hybrid-layer.md).
    from kt_sglang.engine.stream_signal import stream_signal

    try:
        stream_signal()  # on a GPU: the memory operations probed
    except Exception as exc:  # a broken CUDA install should not hide the rest of the report
        advice.append(f"the stream hand-over could not be probed: {exc}")
    print(f"stream signal: {_native.stream_signal_status()}")
    print(f"GPU prefill: {_gpu_prefill_line(advice)}")
    triton_version = _package_version("triton")
    print(f"triton {triton_version or 'not installed'} (split and hot-expert kernels on CUDA)")
    llmcompressor_version = _package_version("llmcompressor")
    print(f"llmcompressor {llmcompressor_version or 'not installed'} (kt-sglang convert-gpu)")
    if not llmcompressor_version:
        advice.append(
            "convert-gpu needs llmcompressor: pip install 'kt-sglang[convert-gpu]' in its own environment"
        )

    for line in advice:
        print(f"note: {line}")
    for line in problems:
        print(f"problem: {line}")
    print("status: " + ("ok" if not problems else f"{len(problems)} problem(s)"))
    return 1 if problems else 0


def _gpu_prefill_line(advice: list[str]) -> str:
    """The pinned copy rate and the threshold `--kt-gpu-prefill-token-threshold auto` would pick for a
    Qwen3-30B-A3B AMXINT4 layer (measured here), or why there is none."""
    import torch

    if not torch.cuda.is_available():
        return "no GPU (--kt-gpu-prefill-token-threshold streams experts to one)"
    from kt_sglang.layer.prefill import reference_crossover

    try:
        found = reference_crossover()
    except Exception as exc:  # a broken CUDA install should not hide the rest of the report
        advice.append(f"the GPU prefill could not be measured: {exc}")
        return "not measured"
    return (
        f"pinned host-to-device {found.h2d_gbps:.1f} GB/s; auto would stream chunks of {found.threshold}+ "
        f"tokens for a Qwen3-30B-A3B AMXINT4 layer (CPU engine {found.cpu_tokens_per_s:,.0f} tokens/s)"
    )
