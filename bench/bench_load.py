"""Host memory and load time of the engine's experts, against the packed bytes of the cold ones.

    python bench/bench_load.py [--layers 1] [--method AMXINT4] [--hot 0 0.25] [--shape H I E]
                               [--workdir DIR] [--out FILE]

Writes a Qwen3-30B-A3B-shaped checkpoint (bf16, per-expert tensors; H 2048, I 768, 128 experts, top-8;
``--shape`` for others), its `kt-sglang convert-cpu` directories (canonical and packed layouts), and
a GGUF file of the same shape (``--gguf-type``, random blocks), then loads every MoE layer in a
fresh process for each source (the checkpoint quantized on load; the converted directories; the
GGUF through LLAMAFILE) and share of hot experts, twice: with the files dropped from the page cache
(cold: all of it as root, else the files' own pages) and again (warm). Reports
per case the load time, the peak (sampled every 2 ms) and final anonymous memory above the
process's before loading (the mapped files' pages are the page cache's, not the engine's), and the
packed bytes of the experts the engine holds; the bound the engine keeps is peak <= final + one
layer's packed experts + 10%. "mapped" is the file-backed memory the process maps at the end (a
packed directory's layers compute from it), and "decode ms" the median time of one token through
the first layer after the load (mapped pages against the engine's own).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

QWEN3_30B = (2048, 768, 128)  # H, I, E
K = 8

# Run in a fresh process per case: RSS high-water marks are per process.
_PROBE = r"""
import json, re, sys, threading, time, torch
from kt_sglang import KTMoEWrapper
import kt_sglang.weights.gguf  # the readers' own imports are not the weights' memory
def rss(kind):  # RssAnon: what the engine allocates; RssFile: mapped files' pages (the page cache's)
    return int(re.search(kind + r":\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024
def anon():
    return rss("RssAnon")
path, method, hot, layers = sys.argv[1], sys.argv[2], float(sys.argv[3]), json.loads(sys.argv[4])
E, K, H, I = json.loads(sys.argv[5])
mask = torch.zeros(E, dtype=torch.bool)
mask[: round(hot * E)] = True
before, file_before = anon(), rss("RssFile")
peak, done = [before], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], anon())
        time.sleep(0.002)
sampler = threading.Thread(target=sample, daemon=True)  # a failed load must not leave it running
sampler.start()
t = time.perf_counter()
held = []
for layer in layers:
    w = KTMoEWrapper(layer, E, K, H, I, mask if hot else None, 2, 1, weight_path=path, method=method)
    w.load_weights()
    held.append(w)
seconds = time.perf_counter() - t
done.set()
sampler.join()
final, mapped = anon(), rss("RssFile") - file_before
# decode: one token through the first layer, routed among its held experts
w, cold = held[0], [e for e in range(E) if not mask[e]]
x = torch.randn(1, H).bfloat16()
times = []
for i in range(60):
    ids = torch.tensor([[cold[(i * K + j) % len(cold)] for j in range(K)]])
    t = time.perf_counter()
    w.forward(x, ids, torch.full((1, K), 1.0 / K))
    times.append(time.perf_counter() - t)
print(json.dumps({"seconds": seconds, "peak": max(peak[0], final) - before, "final": final - before,
                  "mapped": mapped, "decode_ms": sorted(times[10:])[len(times[10:]) // 2] * 1e3,
                  "computes_from_file": w.mapped,
                  "packed": sum(w.packed_bytes for w in held), "layer_packed": held[0].packed_bytes}))
"""

# One token through layer 0 of the converted directory (the engine's own copy) and of the packed one
# (the mapped file), interleaved in one process so that both see the same machine.
_DECODE_AB = r"""
import json, sys, time, torch
from kt_sglang import KTMoEWrapper
copied_path, mapped_path, method, calls = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
E, K, H, I = json.loads(sys.argv[5])
layers = {}
for name, path in (("copied", copied_path), ("mapped", mapped_path)):
    w = KTMoEWrapper(0, E, K, H, I, None, 2, 1, weight_path=path, method=method)
    w.load_weights()
    layers[name] = w
assert layers["mapped"].mapped and not layers["copied"].mapped
x = torch.randn(1, H).bfloat16()
wts = torch.full((1, K), 1.0 / K)
times = {name: [] for name in layers}
for i in range(calls):
    ids = torch.randperm(E)[:K].reshape(1, K)
    for name in (("copied", "mapped") if i % 2 else ("mapped", "copied")):
        t = time.perf_counter()
        layers[name].forward(x, ids, wts)
        times[name].append(time.perf_counter() - t)
med = {name: sorted(v[10:])[len(v[10:]) // 2] * 1e3 for name, v in times.items()}
print(json.dumps({"copied_ms": med["copied"], "mapped_ms": med["mapped"], "calls": calls}))
"""


def write_checkpoint(path: Path, layers: int, H: int, I: int, E: int) -> None:
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "qwen3_moe", "num_experts": E, "num_experts_per_tok": K, "hidden_size": H,
        "moe_intermediate_size": I, "num_hidden_layers": layers, "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(0)
    for layer in range(layers):
        tensors = {}
        for e in range(E):
            for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                name = f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
                tensors[name] = (torch.randn(*shape, generator=gen) / shape[1] ** 0.5).bfloat16()
        save_file(tensors, str(path / f"model-{layer:05d}.safetensors"))


def write_gguf(path: Path, qtype_name: str, layers: int, H: int, I: int, E: int) -> None:
    """The same experts' shapes as a GGUF file (Qwen3-MoE names), random blocks of the type."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

    from kt_sglang.weights.gguf_blocks import random_rows

    qtype = GGMLQuantizationType[qtype_name]
    block = GGML_QUANT_SIZES[qtype][0]
    if H % block or I % block:
        raise SystemExit(f"--gguf-type {qtype_name}: blocks of {block} do not divide H {H} and I {I}")
    w = GGUFWriter(path, "qwen3moe")
    w.add_expert_count(E)
    w.add_embedding_length(H)
    w.add_expert_feed_forward_length(I)
    for layer in range(layers):
        for proj, (N, k) in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            rows = random_rows(qtype, (E, N, k), k**-0.5, seed=3 * layer + len(proj))
            w.add_tensor(f"blk.{layer}.ffn_{proj}_exps.weight", rows, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def drop_page_cache(path: Path) -> bool:
    """Evicts ``path``'s files (a file or a directory's) from the page cache: all of it as root, else
    each file's clean pages (posix_fadvise), which needs no privilege."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        pass
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    try:
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    except (OSError, AttributeError):
        return False
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--method", default="AMXINT4")
    p.add_argument("--hot", type=float, nargs="+", default=[0.0, 0.25])
    p.add_argument(
        "--workdir", type=Path, help="where the checkpoint and its conversion go (default: a temp dir)"
    )
    p.add_argument("--shape", type=int, nargs=3, default=QWEN3_30B, metavar=("H", "I", "E"))
    p.add_argument("--gguf-type", default="Q4_K", help="the GGUF file's block type (LLAMAFILE)")
    p.add_argument("--decode-calls", type=int, default=400, help="interleaved decode calls per layer")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    H, I, E = args.shape
    work = args.workdir or Path(tempfile.mkdtemp(prefix="kt-bench-load-"))
    checkpoint, converted, packed = work / "checkpoint", work / "converted", work / "converted-packed"
    if not (checkpoint / "config.json").exists():
        write_checkpoint(checkpoint, args.layers, H, I, E)
    for out, layout in ((converted, "canonical"), (packed, "packed")):
        if not (out / "kt_weights.json").exists():
            from kt_sglang.weights.convert_cpu import main as convert_cpu

            argv = ["--input-path", str(checkpoint), "--output", str(out), "--quant-method", args.method]
            convert_cpu([*argv, "--layout", layout])
    gguf = work / f"experts-{args.gguf_type}.gguf"
    if not gguf.exists():
        write_gguf(gguf, args.gguf_type, args.layers, H, I, E)
    rows = []
    sources = (
        ("checkpoint, quantized on load", checkpoint, args.method),
        ("converted directory", converted, args.method),
        ("converted directory, packed layout", packed, args.method),
        (f"GGUF {args.gguf_type}", gguf, "LLAMAFILE"),
    )
    for source, path, method in sources:
        for hot in args.hot:
            for cache in ("cold", "warm"):
                dropped = cache == "cold" and drop_page_cache(path)
                shape = json.dumps([E, K, H, I])
                cmd = [
                    sys.executable,
                    "-c",
                    _PROBE,
                    str(path),
                    method,
                    str(hot),
                    json.dumps(list(range(args.layers))),
                    shape,
                ]
                r = subprocess.run(cmd, capture_output=True, text=True, check=True)
                m = json.loads(r.stdout.strip().splitlines()[-1])
                files = (
                    path.stat().st_size
                    if path.is_file()
                    else sum(
                        f.stat().st_size for f in path.iterdir() if f.suffix in (".safetensors", ".ktpack")
                    )
                )
                rows.append({
                    "source": source, "hot_fraction": hot, "cache": "cold" if dropped else "warm",
                    "seconds": m["seconds"], "seconds_per_gb": m["seconds"] / (files / 1e9),
                    "peak_mib": m["peak"] / 2**20, "final_mib": m["final"] / 2**20,
                    "mapped_mib": m["mapped"] / 2**20, "computes_from_file": m["computes_from_file"],
                    "decode_ms": m["decode_ms"],
                    "packed_mib": m["packed"] / 2**20, "layer_packed_mib": m["layer_packed"] / 2**20,
                    "within_bound": m["peak"] <= m["final"] + 1.1 * m["layer_packed"],
                })  # fmt: skip
    cmd = [sys.executable, "-c", _DECODE_AB, str(converted), str(packed), args.method, str(args.decode_calls)]
    r = subprocess.run([*cmd, json.dumps([E, K, H, I])], capture_output=True, text=True, check=True)
    decode = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"{args.layers} layer(s) of H {H}, I {I}, {E} experts, {args.method}, files in {work}")
    print(
        f"decode, one token, interleaved ({decode['calls']} calls each): "
        f"own copy {decode['copied_ms']:.3f} ms, "
        f"mapped file {decode['mapped_ms']:.3f} ms (x{decode['copied_ms'] / decode['mapped_ms']:.3f})"
    )
    print(
        "| source | hot | cache | load s | s per GB read | peak MiB | final MiB | mapped MiB | packed MiB "
        "| in bound | decode ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['source']} | {r['hot_fraction'] * 100:.0f}% | {r['cache']} | {r['seconds']:.2f} | "
            f"{r['seconds_per_gb']:.2f} | {r['peak_mib']:.0f} | {r['final_mib']:.0f} | "
            f"{r['mapped_mib']:.0f} | {r['packed_mib']:.0f} | {'yes' if r['within_bound'] else 'no'} | "
            f"{r['decode_ms']:.2f} |"
        )
    if args.out:
        result = {"method": args.method, "layers": args.layers, "shape": [H, I, E], "rows": rows}
        result["decode_interleaved"] = decode
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
