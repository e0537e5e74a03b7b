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


def run_doctor() -> int:
    """Prints what this machine offers the engine and what to fix; 1 when something blocks it."""
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
        for method, family in _native.kernel_families(chosen).items():
            print(f"    {method} -> {family} kernels")
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
    cores = sum(len(n["cores"]) for n in topo["nodes"])
    print(f"  suggested: --kt-cpuinfer {cores} --kt-threadpool-count {len(topo['nodes'])}")

    print(f"Python {platform.python_version()} ({sys.executable})")
    torch_version = _package_version("torch")
    print(f"torch {torch_version or 'missing'}")
    if not torch_version:
        problems.append("torch is not installed: pip install torch")
    sglang_version = _package_version("sglang")
    print(f"sglang {sglang_version or 'not installed'}")
    if not sglang_version:
        advice.append("serving needs SGLang: pip install 'kt-sglang[sglang]' (Python 3.11)")
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
        print("CUDA driver: found (the engine's submit and sync run as host functions on CUDA streams)")
    else:
        print(f"CUDA driver: {_native.cuda_host_launch_status()} (the engine is called directly)")
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
