"""`kt-sglang`: version, doctor, demo, serve, chat, check-engine, bench, convert-cpu, convert-gpu."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["convert-cpu"]:  # its own parser, shared with `python -m kt_sglang.convert_cpu`
        from kt_sglang.weights.convert_cpu import main as convert_cpu

        return convert_cpu(argv[1:])
    if argv[:1] == ["convert-gpu"]:  # likewise `python -m kt_sglang.convert_gpu`
        from kt_sglang.weights.convert_gpu import main as convert_gpu

        return convert_gpu(argv[1:])
    parser = argparse.ArgumentParser(
        prog="kt-sglang",
        description="SGLang MoE serving with cold experts on the CPU engine of kt-sglang.",
    )
    from kt_sglang.engine.methods import METHODS, method_names, parse_method

    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("version", help="print the version of kt-sglang and of what it runs on")
    doctor = sub.add_parser("doctor", help="check this machine: CPU paths, AMX, NUMA, RAM, packages, GPU")
    doctor.add_argument("--model", default=None, help="a local checkpoint: RAM and disk it needs")
    doctor.add_argument("--method", default="AMXINT4", choices=method_names(), help="for --model")
    sub.add_parser("convert-cpu", help="quantize a checkpoint's experts into the canonical CPU format")
    sub.add_parser("convert-gpu", help="quantize the routed experts for SGLang's GPU side (llmcompressor)")
    demo = sub.add_parser(
        "demo", help="serve the project's small Shakespeare MoE with SGLang and CPU experts, continue a line"
    )
    from kt_sglang.cli.demo import DEFAULT_PROMPT, DEFAULT_WORKDIR

    demo.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help=f"default: {DEFAULT_WORKDIR}")
    quantizing = [m for m in method_names() if METHODS[parse_method(m)].quantizes_dense]
    demo.add_argument(
        "--method", default="AMXINT4", choices=quantizing, help="a method that quantizes the bf16 model"
    )
    demo.add_argument("--gpu-experts", type=int, default=4, help="hot experts per MoE layer (of 16)")
    demo.add_argument("--prompt", default=DEFAULT_PROMPT, help="a speaker and a line, as in the plays")
    demo.add_argument("--max-tokens", type=int, default=64)
    demo.add_argument("--threads", type=int, default=None, help="CPU expert threads (default: all cores)")
    serve = sub.add_parser(
        "serve",
        help="run python -m sglang.launch_server with --kt-* flags chosen for this machine",
        usage="kt-sglang serve [MODEL | --model-path MODEL] [--method M] [--dry-run] [SGLang arguments]",
        description="MODEL: a local Hugging Face model directory, first or as --model-path. Any other "
        "argument goes to SGLang unchanged; --kt-* flags given win over ours.",
    )
    serve.add_argument(
        "--model-path", "--model", dest="model_path", default=None, help="the same, as SGLang spells it"
    )
    serve.add_argument(
        "--method",
        default=None,
        choices=method_names(),
        help="CPU expert method (default: the one a converted --kt-weight-path holds, else AMXINT4)",
    )
    serve.add_argument("--dry-run", action="store_true", help="print the command without running it")
    chat = sub.add_parser("chat", help="interactive streaming chat with a running server")
    chat.add_argument("--url", default="http://127.0.0.1:30000")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.7)
    chat.add_argument("--system", default=None, help="a system prompt that starts the conversation")
    check = sub.add_parser("check-engine", help="the CPU engine alone on a small MoE layer against float32")
    check.add_argument("--threads", type=int, default=None, help="compute threads (default: all cores)")
    bench = sub.add_parser("bench", help="benchmark one MoE layer (decode latency, prefill tokens/s)")
    from kt_sglang.cli.bench import add_arguments

    add_arguments(bench)
    finetune = sub.add_parser("finetune", help="LoRA on a MoE model's routed experts on the CPU engine")
    from kt_sglang.finetune.train import add_arguments as add_finetune_arguments

    add_finetune_arguments(finetune)
    model = None  # `serve MODEL ...`: taken here, as a positional would take SGLang's option values
    if argv[:1] == ["serve"] and len(argv) > 1 and not argv[1].startswith("-"):
        model, argv = argv[1], argv[:1] + argv[2:]
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "serve":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "version":
        from kt_sglang.cli.doctor import print_version

        print_version()
        return 0
    if args.command == "doctor":
        from kt_sglang.cli.doctor import run_doctor

        return run_doctor(args.model, args.method)
    if args.command == "demo":
        from kt_sglang.cli.demo import run_demo

        return run_demo(
            args.workdir, args.method, args.gpu_experts, args.prompt, args.max_tokens, args.threads
        )
    if args.command == "serve":
        from kt_sglang.cli.serve import run_serve

        if model and args.model_path and model != args.model_path:
            parser.error(f"serve: two models given ({model} and --model-path {args.model_path})")
        model = model or args.model_path
        if model is None:
            parser.error("serve: give the model directory (positional or --model-path)")
        return run_serve(model, rest, args.method, args.dry_run)
    if args.command == "chat":
        from kt_sglang.cli.chat import run_chat

        return run_chat(args.url, args.max_tokens, args.temperature, args.system)
    if args.command == "check-engine":
        from kt_sglang.cli.check_engine import run_check_engine

        return run_check_engine(args.threads)
    if args.command == "bench":
        from kt_sglang.cli.bench import run_from_args

        return run_from_args(args)
    if args.command == "finetune":
        from kt_sglang.finetune.train import run

        return run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
