"""`minivllm diverge`: one prompt, two sides, where and why the greedy text splits.

    minivllm diverge --model smollm2-135m --a gemv_max_rows=0 --b gemv_max_rows=4096 --max-tokens 200 "Once upon"
    minivllm diverge --b transformers "Once upon"                 # the engine vs transformers (float32)
    minivllm diverge --a dtype=f32 --b dtype=bf16 "Once upon"     # two activation dtypes
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from minivllm.devices import DTYPE_CHOICES
from minivllm.models import DEFAULT_MODEL


def add_diverge_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "diverge", help="find where two engine configurations' greedy outputs split, and why",
        description="Generate greedily under engine options A and B (same loaded model), report the first "
                    "differing token, both sides' top-k logits there, and per-layer hidden-state differences.")
    p.add_argument("prompt", help="the prompt text (with --chat: the user message)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"registered name or .gguf path (default {DEFAULT_MODEL})")
    p.add_argument("--a", action="append", default=[], metavar="KEY=VALUE",
                   help="engine option for side A (repeatable), e.g. gemv_max_rows=0, device=cuda:0, dtype=f16; "
                        "or the whole side: transformers, llama.cpp")
    p.add_argument("--b", action="append", default=[], metavar="KEY=VALUE",
                   help="engine option for side B (repeatable), e.g. gemv_max_rows=4096; or transformers, llama.cpp")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--top-k", type=int, default=5, help="logits recorded per position (default 5)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--inference-device", default="cpu", help="cpu, gpu (freest CUDA device) or cuda:N")
    p.add_argument("--activation-dtype", default="f32", choices=DTYPE_CHOICES)
    p.add_argument("--json", default=None, metavar="PATH", help="also write the full report as JSON")
    p.add_argument("--quiet", action="store_true", help="no load progress bars")
    p.set_defaults(func=run_diverge)


def run_diverge(args: argparse.Namespace) -> int:
    from minivllm.debug.compare import compare
    from minivllm.debug.sides import parse_side, side_from_text

    # Parse both sides before loading anything: a typo should cost nothing.
    a = side_from_text(args.a, "a")
    b = side_from_text(args.b, "b")
    parse_side(a, "a"), parse_side(b, "b")
    report = compare(args.model, args.prompt, a, b, max_tokens=args.max_tokens, top_k=args.top_k, chat=args.chat,
                     device=args.inference_device, dtype=args.activation_dtype, progress=not args.quiet)
    print(report.summary())
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report.to_dict(), indent=1, ensure_ascii=False) + "\n")
        print(f"\nreport written to {path}", file=sys.stderr)
    return 0
