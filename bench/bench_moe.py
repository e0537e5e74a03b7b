"""The full per-layer benchmark of the CPU engine (issue targets), JSON into bench/results/.

    python bench/bench_moe.py            # Qwen3-30B-A3B and DeepSeek-V3 layers, 2 threads
    python bench/bench_moe.py --threads 1 2 --layers qwen3-30b-a3b

Same options as `kt-sglang bench`; this script only picks the output file.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from kt_sglang.cli.main import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if "--out" not in args:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        args += ["--out", str(Path(__file__).parent / "results" / f"moe-layer-{stamp}.json")]
    sys.exit(main(["bench", *args]))
