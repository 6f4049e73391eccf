"""Batched decode of both engines on one GGUF file: llama.cpp's llama-batched-bench S_TG
and minivllm's decode rate for the same shape (B sequences, 128 prompt tokens each, 128
decode steps; bench/llama_batched_bench.py says how each is measured).

    python3 scripts/gpu_batched_decode.py FILE OUT.json [--llama-batched-bench PATH] [--npl 1,8,32]
        [--option KEY=VALUE ...]

Writes OUT.json: the device, the file, both engines' raw rows and `ratio_vs_llama_cpp`
per B, the llama.cpp command and commit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--llama-batched-bench", default=None)
    ap.add_argument("--npl", default="1,8,32")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--option", action="append", default=[], help="engine option KEY=VALUE (repeatable)")
    args = ap.parse_args()
    from minivllm.bench.llama_batched_bench import compare
    from minivllm.engine.options import parse_overrides

    result = compare(args.model, args.llama_batched_bench, npl=tuple(int(v) for v in args.npl.split(",")),
                     prompt_tokens=args.prompt_tokens, decode_tokens=args.decode_tokens, repeats=args.repeats,
                     engine_options=parse_overrides(args.option))
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
