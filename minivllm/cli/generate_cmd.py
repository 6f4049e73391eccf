"""`minivllm generate`: stream a completion (or a chat reply) to the terminal."""

from __future__ import annotations

import argparse
import sys
import time

from minivllm.devices import DTYPE_CHOICES
from minivllm.engine.options import add_engine_flags, engine_options_from_args
from minivllm.models import DEFAULT_MODEL


def add_generate_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="stream a completion from a model")
    p.add_argument("prompt", help="the prompt text (with --chat: the user message)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"registered name or .gguf path (default {DEFAULT_MODEL})")
    p.add_argument("--inference-device", default="cpu", help="cpu, gpu (freest CUDA device) or cuda:N")
    p.add_argument("--activation-dtype", default="f32", choices=DTYPE_CHOICES)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_engine_flags(p)
    p.add_argument("--trace-directory", default=None,
                   help="write a Chrome trace (Perfetto) of every step to DIR/minivllm-trace-<pid>.json")
    p.add_argument("--quiet", action="store_true", help="no load progress bars or stats")
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from minivllm import LLM, SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        max_tokens=args.max_tokens, seed=args.seed, stop=args.stop,
    )
    if args.trace_directory:
        from minivllm.obs.trace import enable_tracing

        enable_tracing(args.trace_directory)
    llm = LLM(args.model, device=args.inference_device, dtype=args.activation_dtype, progress=not args.quiet,
              draft_model=args.draft_model, **engine_options_from_args(args))
    prompt = args.prompt
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}]
        prompt = llm.chat_prompt_ids(messages)[1]  # ids: message text never becomes control tokens
    else:
        sys.stdout.write(prompt)
    last, tokens, first_at = None, 0, None
    started = time.perf_counter()
    for event in llm.stream(prompt, params):
        sys.stdout.write(event.text)
        sys.stdout.flush()
        last = event
        if event.token_id >= 0:
            tokens += 1
            first_at = first_at or time.perf_counter()
    ended = time.perf_counter()
    sys.stdout.write("\n")
    if not args.quiet and last is not None:
        info = llm.info()
        # The first token closes the prefill; decode speed counts the tokens after it.
        ttft = (first_at or ended) - started
        decode = (tokens - 1) / (ended - first_at) if tokens > 1 and first_at and ended > first_at else 0.0
        print(f"[{info['device']}, {info['activation_dtype']}] finish={last.finish_reason} tokens={tokens} "
              f"ttft={ttft:.3f}s decode={decode:.1f} tok/s", file=sys.stderr)
        if llm.draft is not None:
            s = llm.snapshot()["speculative"]
            rate = s["acceptance_rate"]
            print(f"[speculative: {s['policy']}, tv_budget {s['tv_budget']}] rounds={s['rounds']} "
                  f"accepted {s['accepted']}/{s['proposed']} ({'-' if rate is None else f'{rate:.1%}'}) "
                  f"bonus={s['bonus_tokens']} plain_steps={s['plain_steps']} "
                  f"draft lengths={s['draft_length_histogram']}", file=sys.stderr)
    return 0
