"""`python -m kt_sglang.convert_cpu`: same as `kt-sglang convert-cpu`."""

from __future__ import annotations

import sys

from kt_sglang.weights.convert_cpu import build_parser, convert

if __name__ == "__main__":
    args = build_parser("python -m kt_sglang.convert_cpu").parse_args()
    try:
        convert(args)
    except ValueError as exc:  # CheckpointError is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
