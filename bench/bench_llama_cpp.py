"""Side by side with llama.cpp on the same GGUF file: one MoE layer's decode and prefill.

    pip install --no-deps --target DIR llama-cpp-python==0.3.36   # builds llama.cpp for this CPU
    python bench/bench_llama_cpp.py --llama-cpp-site DIR [--types Q4_K Q8_0] [--threads 2]

For each GGUF type the script writes a Qwen3-MoE model
whose blocks are the benchmark layer's experts (random blocks of that type) behind a minimal
attention (one head of 64) and a vocabulary of 256, enough blocks to cover the working set. llama.cpp
runs the whole model (``llama_cpp.Llama.eval``) in a process of its own (this interpreter, with DIR
on its path); our engine runs each block's
experts (``--kt-method LLAMAFILE`` on the same file) in this one, the two interleaved repeat by
repeat. llama.cpp's time per block includes its router, attention and norms: about 2% of the
experts' work at the Qwen3-30B-A3B shape (counted in the JSON as ``other_flop_share``).

Decode is one token a call (ours: random routing, each call a different block, as a token passes
through every block); prefill is one batch of T tokens. Prints a table and writes JSON
(``--out``, default bench/results/llama-cpp-<time>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter

from kt_sglang.cli.bench import LAYERS, read_bandwidth_gbs
from kt_sglang.engine import KTMoEWrapper
from kt_sglang.engine.native import _native
from kt_sglang.weights.gguf_blocks import random_rows

VOCAB, HEAD_DIM, CONTEXT = 256, 64, 4096


def write_model(path: Path, qtype: GGMLQuantizationType, H: int, I: int, E: int, k: int, blocks: int) -> None:
    """A Qwen3-MoE GGUF whose every block holds random experts of ``qtype`` (the rest float32)."""
    rng = np.random.default_rng(0)
    w = GGUFWriter(path, "qwen3moe")
    w.add_context_length(CONTEXT)
    w.add_embedding_length(H)
    w.add_block_count(blocks)
    w.add_feed_forward_length(I)
    w.add_head_count(1)
    w.add_head_count_kv(1)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_expert_count(E)
    w.add_expert_used_count(k)
    w.add_expert_feed_forward_length(I)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("none")

    def dense(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / shape[-1] ** 0.5).astype(np.float32)

    w.add_tensor("token_embd.weight", dense(VOCAB, H))
    w.add_tensor("output_norm.weight", np.ones(H, np.float32))
    w.add_tensor("output.weight", dense(VOCAB, H))
    for b in range(blocks):
        for name, t in (
            ("attn_norm", np.ones(H, np.float32)),
            ("attn_q", dense(HEAD_DIM, H)),
            ("attn_k", dense(HEAD_DIM, H)),
            ("attn_v", dense(HEAD_DIM, H)),
            ("attn_output", dense(H, HEAD_DIM)),
            ("attn_q_norm", np.ones(HEAD_DIM, np.float32)),
            ("attn_k_norm", np.ones(HEAD_DIM, np.float32)),
            ("ffn_norm", np.ones(H, np.float32)),
            ("ffn_gate_inp", dense(E, H)),
        ):
            w.add_tensor(f"blk.{b}.{name}.weight", t)
        for proj, (N, K) in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            rows = random_rows(qtype, (E, N, K), K**-0.5, seed=b * 3 + len(proj))
            w.add_tensor(f"blk.{b}.ffn_{proj}_exps.weight", rows, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


class LlamaCpp:
    """llama.cpp in a process of its own (llama_cpp_worker.py), llama-cpp-python from ``site``."""

    def __init__(self, site: str, path: Path, threads: int) -> None:
        script = Path(__file__).with_name("llama_cpp_worker.py")
        env = os.environ | {"PYTHONPATH": site}
        self._proc = subprocess.Popen(
            [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        loaded = self.request(op="load", path=str(path), threads=threads, context=CONTEXT)
        self.version, self.system_info = loaded["llama_cpp"], loaded["system_info"]

    def request(self, **request) -> dict:
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise SystemExit(f"the llama.cpp worker exited with {self._proc.wait()}; its stderr is above")
        reply = json.loads(line)
        if "error" in reply:
            raise SystemExit(f"llama.cpp worker, {request['op']}: {reply['error']}")
        return reply

    def close(self) -> None:
        self._proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
        self._proc.stdin.close()
        self._proc.wait()


def routed(T: int, H: int, E: int, k: int, gen: torch.Generator):
    x = torch.randn(T, H, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    return x, ids, torch.softmax(torch.randn(T, k, generator=gen), -1)


def bench_type(name: str, args: argparse.Namespace, gen: torch.Generator) -> dict:
    """One GGUF type: its model written, loaded by both engines, decode and prefill timed."""
    H, I, E, k = LAYERS[args.layer]
    qtype = GGMLQuantizationType[name]
    per_block = 3 * H * I * E * random_rows(qtype, (1, 256), 1.0).nbytes / 256
    blocks = max(2, round(args.working_set_gib * 2**30 / per_block))
    with tempfile.TemporaryDirectory(prefix="kt-llama-cpp-") as tmp:
        path = Path(tmp) / f"{args.layer}-{name}.gguf"
        print(f"{name}: writing {blocks} blocks ({blocks * per_block / 2**30:.1f} GiB) ...", flush=True)
        write_model(path, qtype, H, I, E, k, blocks)
        layers = []
        for b in range(blocks):
            layer = KTMoEWrapper(
                b, E, k, H, I, None, args.threads, 1, weight_path=str(path), method="LLAMAFILE", isa=args.isa
            )
            layer.load_weights()
            layers.append(layer)
        llama = LlamaCpp(args.llama_cpp_site, path, args.threads)
        row = {
            "type": name,
            "blocks": blocks,
            "isa": layers[0].isa,
            "llama_cpp": llama.version,
            "llama_cpp_system_info": llama.system_info,
            "methods": [layers[0].method.value, layers[0].down_method.value],
        }
        llama.request(op="decode", tokens=4, seed=0)  # warm: pages in, scratch sized
        for layer in layers:
            layer.forward(*routed(1, H, E, k, gen))
        # decode: ours, a token's pass over the blocks; theirs, a token; a read bandwidth probe (the
        # VM's drifts over minutes); repeat by repeat
        ours, theirs, probes = [], [], []
        for r in range(args.repeats):
            probes.append(read_bandwidth_gbs(args.threads, gib=0.5, repeats=2))
            for _ in range(args.decode_tokens):
                start = time.perf_counter()
                for layer in layers:
                    layer.forward(*routed(1, H, E, k, gen))
                ours.append((time.perf_counter() - start) / blocks)
            timed = llama.request(op="decode", tokens=args.decode_tokens + 1, seed=r)["seconds"]
            theirs += [s / blocks for s in timed]
        row["decode"] = point(ours, theirs)
        bw = statistics.median(probes)
        touched = k * layers[0].packed_bytes / E  # the token's experts' packed bytes in one block
        row["decode"] |= {
            "read_bandwidth_gbs": bw,
            "bw_fraction": touched / (row["decode"]["ms"] / 1e3) / 1e9 / bw,
        }
        row["prefill"] = {}
        for T in args.prefill_tokens:
            ours, theirs = [], []
            for r in range(args.repeats):
                x = routed(T, H, E, k, gen)
                start = time.perf_counter()
                layers[r % blocks].forward(*x)
                ours.append(time.perf_counter() - start)
                theirs.append(llama.request(op="prefill", tokens=T, seed=r)["seconds"] / blocks)
            row["prefill"][T] = point(ours, theirs) | {"tokens_per_s": T / statistics.median(ours)}
        llama.close()
        del layers
    return row


def point(ours: list[float], theirs: list[float]) -> dict:
    t_ours, t_theirs = statistics.median(ours), statistics.median(theirs)
    return {"ms": t_ours * 1e3, "llama_cpp_ms": t_theirs * 1e3, "vs_llama_cpp": t_theirs / t_ours}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--llama-cpp-site", required=True, help="where llama-cpp-python is installed (pip --target)"
    )
    p.add_argument("--layer", choices=sorted(LAYERS), default="qwen3-30b-a3b")
    p.add_argument("--types", nargs="+", default=["Q4_K", "Q8_0"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--isa", default=None, help="our kernel family (default: the best this CPU runs)")
    p.add_argument("--decode-tokens", type=int, default=24, help="tokens per decode repeat")
    p.add_argument("--prefill-tokens", type=int, nargs="+", default=[128, 512])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--working-set-gib", type=float, default=2.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    H, I, E, k = LAYERS[args.layer]
    gen = torch.Generator().manual_seed(1)
    results = {
        "machine": {"cpu": _native.cpu_features()["brand"]},
        "config": vars(args),
        "other_flop_share": (4 * HEAD_DIM * H + E * H) / (3 * k * H * I),
        "rows": [],
    }
    for name in args.types:
        row = bench_type(name, args, gen)
        results["rows"].append(row)
        d = row["decode"]
        print(
            f"{name} ({row['isa']}, {'/'.join(row['methods'])}): decode {d['ms']:.2f} ms a block "
            f"({d['bw_fraction']:.0%} of read BW), llama.cpp {d['llama_cpp_ms']:.2f} ms: "
            f"x{d['vs_llama_cpp']:.2f}"
        )
        for T, pt in row["prefill"].items():
            print(
                f"  prefill {T}: {pt['ms']:.1f} ms, llama.cpp {pt['llama_cpp_ms']:.1f} ms: "
                f"x{pt['vs_llama_cpp']:.2f}"
            )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or Path(__file__).parent / "results" / f"llama-cpp-{stamp}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
