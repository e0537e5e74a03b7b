"""`kt-sglang`: version, doctor, demo, bench."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["convert-cpu"]:  # its own parser, shared with `python -m kt_sglang.convert_cpu`
        from kt_sglang.weights.convert_cpu import main as convert_cpu

        return convert_cpu(argv[1:])
    parser = argparse.ArgumentParser(
        prog="kt-sglang",
        description="SGLang MoE serving with cold experts on the CPU engine of kt-sglang.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("version", help="print the version of kt-sglang and of what it runs on")
    sub.add_parser("doctor", help="check this machine: CPU paths, AMX, NUMA, Python packages, GPU")
    sub.add_parser("convert-cpu", help="quantize a checkpoint's experts into the canonical CPU format")
    demo = sub.add_parser("demo", help="run the CPU engine on a small MoE layer against a float32 reference")
    demo.add_argument("--threads", type=int, default=None, help="compute threads (default: all cores)")
    bench = sub.add_parser("bench", help="benchmark one MoE layer (decode latency, prefill tokens/s)")
    from kt_sglang.cli.bench import add_arguments

    add_arguments(bench)
    args = parser.parse_args(argv)
    if args.command == "version":
        from kt_sglang.cli.doctor import print_version

        print_version()
        return 0
    if args.command == "doctor":
        from kt_sglang.cli.doctor import run_doctor

        return run_doctor()
    if args.command == "demo":
        from kt_sglang.cli.demo import run_demo

        return run_demo(args.threads)
    if args.command == "bench":
        from kt_sglang.cli.bench import run_from_args

        return run_from_args(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
