"""`python -m kt_sglang.convert_cpu`: same as `kt-sglang convert-cpu`."""

from __future__ import annotations

import sys

from kt_sglang.weights.convert_cpu import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m kt_sglang.convert_cpu"))
