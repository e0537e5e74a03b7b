"""Times llama.cpp on a GGUF model for bench/bench_llama_cpp.py, in the llama-cpp-python environment.

Run by that environment's interpreter, so it imports only the standard library and llama_cpp.

Protocol: one JSON request per line on stdin, one JSON reply per line on stdout:
  {"op": "load", "path", "threads", "context"}       -> {"llama_cpp": version, "system_info": its build's ISA}
  {"op": "decode", "tokens", "seed"}                  -> {"seconds": [per token]}
  {"op": "prefill", "tokens", "seed"}                 -> {"seconds": one batch of that many tokens}
  {"op": "exit"}
An error replies {"error": "..."}.
"""

from __future__ import annotations

import json
import random
import sys
import time
import traceback


def main() -> None:
    import llama_cpp

    llm = None
    for line in sys.stdin:
        request = json.loads(line)
        try:
            op = request["op"]
            if op == "exit":
                break
            if op == "load":
                llm = llama_cpp.Llama(
                    model_path=request["path"],
                    n_threads=request["threads"],
                    n_threads_batch=request["threads"],
                    n_ctx=request["context"],
                    n_batch=512,
                    n_ubatch=512,
                    verbose=False,
                )
                reply = {
                    "llama_cpp": llama_cpp.__version__,
                    "system_info": llama_cpp.llama_print_system_info().decode().strip(),
                }
            elif op in ("decode", "prefill"):
                rng = random.Random(request["seed"])
                tokens = [rng.randrange(llm.n_vocab()) for _ in range(request["tokens"])]
                llm.reset()
                if op == "decode":
                    llm.eval(tokens[:1])  # the first token's cache entry
                    seconds = []
                    for t in tokens[1:]:
                        start = time.perf_counter()
                        llm.eval([t])
                        seconds.append(time.perf_counter() - start)
                    reply = {"seconds": seconds}
                else:
                    start = time.perf_counter()
                    llm.eval(tokens)
                    reply = {"seconds": time.perf_counter() - start}
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception:
            reply = {"error": traceback.format_exc()}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
