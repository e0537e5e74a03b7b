"""A bounded soak of the real server: hundreds of requests, concurrency 1-8, streaming, clients that
hang up, malformed requests; the server's memory over time, with and without CPU experts.

    python bench/bench_soak.py [--requests 400] [--modes cpu-experts,sglang-moe] [--out FILE]

Serves the project's Shakespeare MoE on the CPU device: `cpu-experts` with the plugin's CPU experts
(AMXINT4, 4 hot experts per layer, 1 deferred per token), `sglang-moe` with SGLang's own MoE (no
`--kt-*` flags). The plugin stays loaded in both: SGLang 0.5.23 alone cannot serve on a CPU without
it (its rotary embedding imports vllm there), and its request checks apply to both. Per mode it
reports: responses by status class (a 5xx or a dead server is a failure), whether the greedy
continuation of a fixed prompt is the same at the end as at the start, and the resident memory (RSS)
of the server's process tree every ``--sample-every`` requests. Exit status 1 when a mode failed.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kt_sglang.cli.server import CPU_DEVICE_ARGS, SGLangServer, free_port, server_command
from kt_sglang.shakespeare.model import MODEL_DIR

PROMPTS = ["ROMEO:\n", "JULIET:\nO Romeo, Romeo!", "KING LEAR:\n", "First Witch:\n", "HAMLET:\nTo be"]
GREEDY = {"prompt": "HAMLET:\nTo be, or not to be", "max_tokens": 24, "temperature": 0}


def _tree_rss_mib(pid: int) -> float:
    """Resident memory of a process and all its descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def _request(port: int, method: str, path: str, body: bytes | None, read_chunks: int | None = None):
    """(status, body); ``read_chunks``: read that many chunks of a stream and hang up."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if read_chunks is not None:
            for _ in range(read_chunks):
                if not resp.readline():
                    break
            return resp.status, b""
        return resp.status, resp.read()
    finally:
        conn.close()


def _one(port: int, i: int, rng: random.Random, model: str) -> tuple[str, int, bytes]:
    """One request of a kind picked by ``i``; returns (kind, HTTP status, the body of an error)."""
    prompt = rng.choice(PROMPTS)
    kind = ["complete", "stream", "hang-up", "chat", "malformed"][i % 5]
    if kind == "complete":
        body = {"model": model, "prompt": prompt, "max_tokens": rng.randint(1, 24), "temperature": 0.8}
        return kind, _request(port, "POST", "/v1/completions", json.dumps(body).encode())[0], b""
    if kind in ("stream", "hang-up"):
        body = {"model": model, "prompt": prompt, "max_tokens": 24, "stream": True}
        chunks = 2 if kind == "hang-up" else None
        return kind, _request(port, "POST", "/v1/completions", json.dumps(body).encode(), chunks)[0], b""
    if kind == "chat":
        messages = [{"role": "user", "content": prompt}]
        body = {"model": model, "messages": messages, "max_tokens": 12}
        return kind, _request(port, "POST", "/v1/chat/completions", json.dumps(body).encode())[0], b""
    bad = [
        b'{"model": "x", "prompt": ',  # not JSON
        json.dumps({"model": model, "prompt": "", "max_tokens": 4}).encode(),
        json.dumps({"input_ids": [], "sampling_params": {"max_new_tokens": 2}}).encode(),
        json.dumps({"input_ids": [1, 10**9], "sampling_params": {"max_new_tokens": 2}}).encode(),
        json.dumps({"model": model, "prompt": "ROMEO:", "max_tokens": -3}).encode(),
        json.dumps({"model": model, "prompt": "ROMEO:", "max_tokens": 2, "logprobs": 10**6}).encode(),
        json.dumps(
            {"text": "ROMEO:", "return_logprob": True, "top_logprobs_num": 10**6, "sampling_params": {}}
        ).encode(),
    ][(i // 5) % 7]
    path = "/generate" if b"input_ids" in bad or b'"text"' in bad else "/v1/completions"
    return (f"malformed {(i // 5) % 7}", *_request(port, "POST", path, bad))


def soak(mode: str, requests: int, sample_every: int, workdir: Path, seed: int = 0) -> dict:
    args = list(CPU_DEVICE_ARGS)
    if mode == "cpu-experts":
        args += ["--kt-weight-path", str(MODEL_DIR), "--kt-method", "AMXINT4", "--kt-cpuinfer", "2"]
        args += ["--kt-num-gpu-experts", "4", "--kt-max-deferred-experts-per-token", "1"]
    port = free_port()
    rng = random.Random(seed)
    statuses: dict[str, dict[int, int]] = {}
    errors: dict[str, str] = {}  # the first error body of each kind
    rss: list[tuple[int, float]] = []
    with SGLangServer(server_command(MODEL_DIR, args, port), workdir / f"server-{mode}.log", port) as server:
        before = server.post("/v1/completions", {"model": str(MODEL_DIR), **GREEDY})["choices"][0]["text"]
        rss.append((0, _tree_rss_mib(server.proc.pid)))
        done = 0
        started = time.perf_counter()
        while done < requests:
            concurrency = rng.choice([1, 2, 4, 8])
            batch = list(range(done, min(requests, done + concurrency * 4)))
            with ThreadPoolExecutor(concurrency) as pool:
                for kind, status, body in pool.map(
                    lambda i: _one(port, i, random.Random(seed + i), str(MODEL_DIR)), batch
                ):
                    statuses.setdefault(kind, {}).setdefault(status, 0)
                    statuses[kind][status] += 1
                    if status >= 400:
                        errors.setdefault(kind, body.decode(errors="replace")[:300])
            previous, done = done, batch[-1] + 1
            if done // sample_every != previous // sample_every or done == requests:
                rss.append((done, _tree_rss_mib(server.proc.pid)))
        seconds = time.perf_counter() - started
        after = server.post("/v1/completions", {"model": str(MODEL_DIR), **GREEDY})["choices"][0]["text"]
        alive = server.proc.poll() is None
    server_errors = sum(n for by in statuses.values() for s, n in by.items() if s >= 500)
    ok = alive and server_errors == 0 and before == after
    return {
        "mode": mode,
        "requests": requests,
        "seconds": seconds,
        "statuses": {k: {str(s): n for s, n in v.items()} for k, v in sorted(statuses.items())},
        "server_errors": server_errors,
        "error_messages": dict(sorted(errors.items())),
        "alive": alive,
        "greedy_unchanged": before == after,
        "greedy": before,
        "rss_mib": rss,
        "rss_growth_mib": rss[-1][1] - rss[0][1],
        "ok": ok,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--modes", default="cpu-experts,sglang-moe", help="cpu-experts, sglang-moe or both")
    parser.add_argument("--sample-every", type=int, default=40, help="requests between RSS samples")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="kt-soak-") as tmp:
        for mode in args.modes.split(","):
            r = soak(mode, args.requests, args.sample_every, Path(tmp))
            results.append(r)
            print(
                f"{mode}: {r['requests']} requests in {r['seconds']:.0f} s, {r['server_errors']} 5xx, "
                f"alive {r['alive']}, greedy unchanged {r['greedy_unchanged']}, "
                f"RSS {r['rss_mib'][0][1]:.0f} -> {r['rss_mib'][-1][1]:.0f} MiB",
                flush=True,
            )
            for kind, by in r["statuses"].items():
                print(f"  {kind:<12} {by}")
    if args.out:
        args.out.write_text(json.dumps({"results": results}, indent=1) + "\n")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
