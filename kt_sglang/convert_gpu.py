"""`python -m kt_sglang.convert_gpu`: same as `kt-sglang convert-gpu`."""

from __future__ import annotations

import sys

from kt_sglang.weights.convert_gpu import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m kt_sglang.convert_gpu"))
