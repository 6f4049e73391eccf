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
import os
import sys
import time
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
    import torch

    from minivllm.bench.llama_batched_bench import llama_batched_rows, minivllm_batched_decode
    from minivllm.engine.llm import LLM
    from minivllm.engine.options import parse_overrides

    npl = tuple(int(v) for v in args.npl.split(","))
    options = parse_overrides(args.option)
    max_len = args.prompt_tokens + args.decode_tokens + 8
    llm = LLM(args.model, device="cuda", dtype="float16", progress=False, max_model_len=max_len,
              max_active_requests=max(npl), **options)
    rows = []
    for b in npl:
        t0 = time.time()
        r = minivllm_batched_decode(llm, b, args.prompt_tokens, args.decode_tokens, repeats=args.repeats)
        print(f"minivllm B={b}: {r['decode_tok_s']:.1f} tok/s (samples {[round(s, 1) for s in r['samples']]}, "
              f"{time.time() - t0:.0f} s)", flush=True)
        rows.append(r)
    del llm
    torch.cuda.empty_cache()
    peer = []
    if args.llama_batched_bench:
        peer = llama_batched_rows(args.llama_batched_bench, args.model, args.prompt_tokens, args.decode_tokens, npl)
        for p in peer:
            print(f"llama.cpp: {p.get('status')} B={p.get('sequences')} S_TG={p.get('decode_tok_s')}", flush=True)
    by_b = {p["sequences"]: p for p in peer if p.get("status") == "ok"}
    for r in rows:
        p = by_b.get(r["sequences"])
        if p is not None:
            r["llama_cpp_decode_tok_s"] = p["decode_tok_s"]
            r["ratio_vs_llama_cpp"] = r["decode_tok_s"] / p["decode_tok_s"]
    meta = {"device": torch.cuda.get_device_name(0), "model": str(args.model), "options": options,
            "commit": os.environ.get("MINIVLLM_COMMIT", "unknown"),
            "env": {k: v for k, v in os.environ.items() if k.startswith("MINIVLLM_GPU") or k in
                    ("MINIVLLM_Q8_GEMV", "MINIVLLM_GEMV_CONFIGS", "MINIVLLM_GEMV_KERNEL")},
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "minivllm_measure": "B random-token prompts of P tokens through LLM.generate (f16, greedy, EOS ignored); "
                                "S_TG = B * (G - 1) / (t_G - t_1), median of the repeats after one warm-up",
            "llama_cpp_measure": "llama-batched-bench speed_tg = B * G / t_tg"}
    Path(args.out).write_text(json.dumps({"meta": meta, "minivllm": rows, "llama_cpp": peer}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
