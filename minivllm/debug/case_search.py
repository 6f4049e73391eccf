"""Look for prompts on which two engine configurations split late: a long identical prefix, then a flip.

A late split is the instructive case (two runs that agree for hundreds of characters):
the kernel difference is there from the first token, sits in the KV cache, and only
shows once some greedy choice is close enough to flip.

    python -m minivllm.debug.case_search --model smollm2-135m --a gemv_max_rows=0 --b gemv_max_rows=4096 \\
        --max-tokens 200 --prompts data/divergence/search_prompts.json

prints one line per prompt (split position, identical characters, margins) and the
best prompt's `minivllm diverge` command line. Generation only: the per-layer replay
runs once, in `minivllm diverge`, for the prompt chosen.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass


@dataclass
class SearchHit:
    prompt: str
    split: int | None  # generated-token index of the first difference (None: no split within max_tokens)
    identical_chars: int | None
    a_margin: float | None
    b_margin: float | None


def search(llm, prompts: list[str], a: dict, b: dict, *, max_tokens: int, chat: bool = False,
           log=None) -> list[SearchHit]:
    from minivllm.debug.compare import compare

    hits = []
    for prompt in prompts:
        report = compare(llm, prompt, a, b, max_tokens=max_tokens, top_k=2, chat=chat, hidden_states=False)
        fd = report.first_divergence
        hit = SearchHit(prompt, fd.position if fd else None, fd.identical_chars if fd else None,
                        fd.a_margin if fd else None, fd.b_margin if fd else None)
        hits.append(hit)
        if log:
            log(f"split={hit.split!s:>5} chars={hit.identical_chars!s:>5}  {prompt[:70]!r}")
    return hits


def main(argv: list[str] | None = None) -> int:
    from minivllm import LLM
    from minivllm.engine.options import parse_overrides

    p = argparse.ArgumentParser(prog="python -m minivllm.debug.case_search", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--a", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--b", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--chat", action="store_true")
    p.add_argument("--inference-device", default="cpu")
    p.add_argument("--activation-dtype", default="f32")
    p.add_argument("--prompts", required=True, help='JSON file with {"prompts": [...]}')
    args = p.parse_args(argv)
    a, b = parse_overrides(args.a, "a"), parse_overrides(args.b, "b")
    with open(args.prompts) as f:
        prompts = json.load(f)["prompts"]
    llm = LLM(args.model, device=args.inference_device, dtype=args.activation_dtype, progress=False)
    hits = search(llm, prompts, a, b, max_tokens=args.max_tokens, chat=args.chat,
                  log=lambda line: print(line, flush=True))
    split = [h for h in hits if h.split is not None]
    if not split:
        print("no prompt split within max_tokens", file=sys.stderr)
        return 1
    best = max(split, key=lambda h: h.split)
    opts = " ".join([f"--a {x}" for x in args.a] + [f"--b {x}" for x in args.b])
    print(f"\nlatest split: token {best.split} ({best.identical_chars} identical characters), "
          f"margins a={best.a_margin} b={best.b_margin}")
    print(f"minivllm diverge --model {args.model} {opts} --max-tokens {best.split + 16}"
          f"{' --chat' if args.chat else ''} {json.dumps(best.prompt)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
