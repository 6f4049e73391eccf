"""`minivllm generate`: stream a completion (or a chat reply) to the terminal."""

from __future__ import annotations

import argparse
import sys
import time

from minivllm.devices import DTYPE_CHOICES
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
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-mode", default="paged", choices=("paged", "contiguous"))
    p.add_argument("--page-size", type=int, default=16)
    add_kernel_arguments(p)
    add_prefix_cache_arguments(p)
    add_speculative_arguments(p)
    p.add_argument("--trace-directory", default=None,
                   help="write a Chrome trace (Perfetto) of every step to DIR/minivllm-trace-<pid>.json")
    p.add_argument("--quiet", action="store_true", help="no load progress bars or stats")
    p.set_defaults(func=run_generate)


def add_kernel_arguments(p: argparse.ArgumentParser) -> None:
    """The kernel options every engine-running command takes (see kernels/kernel_options.py)."""
    p.add_argument("--gemv-max-rows", type=int, default=None,
                   help="rows up to which the fused dequantize-GEMV runs (0 = never; default: per device)")
    p.add_argument("--dequant-cache", dest="dequant_cache", action="store_const", const=True, default="auto",
                   help="keep dequantized weights for GEMM (default: on CPU yes, on CUDA no)")
    p.add_argument("--no-dequant-cache", dest="dequant_cache", action="store_const", const=False)
    p.add_argument("--batch-invariant", action="store_true",
                   help="each row's arithmetic independent of batch, chunking and GEMV threshold (slower)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")


def add_prefix_cache_arguments(p: argparse.ArgumentParser) -> None:
    """Prefix-cache options (see cache/prefix_index.py and cache/flight_coordinator.py)."""
    p.add_argument("--prefix-cache", choices=("off", "on"), default=None,
                   help="share full KV pages between requests with a common prefix (default: on, except for "
                        "generate's --kv-mode contiguous)")
    p.add_argument("--publication", choices=("at_completion", "incremental"), default="incremental",
                   help="when a request's full pages become reusable (default incremental: after each forward)")
    p.add_argument("--single-flight", choices=("off", "at_completion", "after_prefill"), default="off",
                   help="identical prompts wait for one leader's pages, released when it ends or after its prefill")


def add_speculative_arguments(p: argparse.ArgumentParser) -> None:
    """Speculative-decoding options (see minivllm/spec/)."""
    p.add_argument("--draft-model", default=None,
                   help="a smaller model with the same tokenizer that proposes tokens for the target to verify")
    p.add_argument("--num-draft-tokens", type=int, default=4,
                   help="draft tokens per round: k of 'fixed', the starting k of the adaptive policies (default 4)")
    p.add_argument("--draft-policy", default="fixed",
                   help="fixed[:k], acceptance-rate[:init,dec,inc,min,max], accepted-length[:init,alpha,min,max], "
                        "adaptive (acceptance-rate that stops speculating while it does not pay), or any policy "
                        "with '+gate' (default fixed)")
    p.add_argument("--tv-budget", type=float, default=0.0,
                   help="mentored decoding: total-variation budget D in [0, 1]; 0 = lossless (default), 1 = accept "
                        "every draft token")


def speculative_options_from(args: argparse.Namespace) -> dict:
    return {"draft_model": args.draft_model, "num_draft_tokens": args.num_draft_tokens,
            "draft_policy": args.draft_policy, "tv_budget": args.tv_budget}


def prefix_cache_options_from(args: argparse.Namespace) -> dict:
    return {"prefix_cache": None if args.prefix_cache is None else args.prefix_cache == "on",
            "publication": args.publication, "single_flight": args.single_flight}


def kernel_options_from(args: argparse.Namespace) -> dict:
    return {"gemv_max_rows": args.gemv_max_rows, "dequant_cache": args.dequant_cache,
            "batch_invariant": args.batch_invariant, "enforce_eager": args.enforce_eager}


def run_generate(args: argparse.Namespace) -> int:
    from minivllm import LLM, SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        max_tokens=args.max_tokens, seed=args.seed, stop=args.stop,
    )
    if args.trace_directory:
        from minivllm.obs.trace import enable_tracing

        enable_tracing(args.trace_directory)
    llm = LLM(args.model, device=args.inference_device, dtype=args.activation_dtype,
              max_model_len=args.max_model_len, progress=not args.quiet,
              kv_mode=args.kv_mode, page_size=args.page_size, **kernel_options_from(args),
              **prefix_cache_options_from(args), **speculative_options_from(args))
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
