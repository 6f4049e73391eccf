"""`minivllm bench ...`: benchmark drivers that write benchmarks/results/*.json + .md."""

from __future__ import annotations

import argparse


def add_bench_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="run a benchmark and write results to benchmarks/results/")
    sub = p.add_subparsers(dest="bench", required=True)

    g = sub.add_parser("gguf-open", help="time opening GGUF files (metadata, index, tokenizer)")
    g.add_argument("--model", action="append", default=None, help="model name or path (repeatable)")
    g.add_argument("--repeats", type=int, default=5)
    g.add_argument("--baseline", action="store_true", help="also time gguf.GGUFReader")
    g.set_defaults(func=_gguf_open)

    d = sub.add_parser("decode", help="single-request prefill/decode speed per device and dtype")
    d.add_argument("--model", default="smollm2-135m")
    d.add_argument("--inference-device", action="append", default=None, help="repeatable: cpu, gpu, cuda:N")
    d.add_argument("--activation-dtype", action="append", default=None, help="repeatable: f32, f16, bf16")
    d.add_argument("--max-tokens", type=int, default=64)
    d.add_argument("--repeats", type=int, default=3)
    d.set_defaults(func=_decode)


def _gguf_open(args: argparse.Namespace) -> int:
    from minivllm.bench.gguf_open import run

    run(args.model or ["smollm2-135m", "qwen2.5-coder-0.5b"], repeats=args.repeats, baseline=args.baseline)
    return 0


def _decode(args: argparse.Namespace) -> int:
    from minivllm.bench.decode import run

    run(args.model, args.inference_device or ["cpu"], args.activation_dtype or ["f32"],
        max_tokens=args.max_tokens, repeats=args.repeats)
    return 0
