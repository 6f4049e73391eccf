"""llama.cpp's `llama-batched-bench` as the GPU peer of batched decode, on the same file.

    PATH -m FILE -ngl 99 -c CTX -npp P -ntg G -npl 1,8,32 --output-format jsonl

runs, for each parallel-sequence count B, B prompts of P tokens (prefilled together) and
then G decode steps of B tokens; its `speed_tg` (S_TG) is B * G / (time of the decode
steps alone). `minivllm_batched_decode` measures the same quantity for minivllm through
`LLM.generate` (B random prompts of P tokens, greedy, EOS ignored): the wall time of G
output tokens minus that of 1 output token is the time of G - 1 decode steps, so
S_TG = B * (G - 1) / (t_G - t_1), prefill excluded as in llama.cpp's figure.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from minivllm.errors import ConfigError

DEFAULT_NPL = (1, 8, 32)


def batched_bench_command(binary: str, model_path: str | Path, prompt_tokens: int = 128, decode_tokens: int = 128,
                          npl: tuple[int, ...] = DEFAULT_NPL) -> list[str]:
    ctx = max(npl) * (prompt_tokens + decode_tokens) + 256
    return [str(binary), "-m", str(model_path), "-ngl", "99", "-c", str(ctx), "-npp", str(prompt_tokens),
            "-ntg", str(decode_tokens), "-npl", ",".join(map(str, npl)), "--output-format", "jsonl"]


def parse_jsonl(text: str) -> list[dict]:
    """The result lines of `--output-format jsonl` (other lines, e.g. logs, skipped)."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            rows.append(json.loads(line))
    return rows


def llama_batched_rows(binary: str, model_path: str | Path, prompt_tokens: int = 128, decode_tokens: int = 128,
                       npl: tuple[int, ...] = DEFAULT_NPL, timeout: float = 900.0) -> list[dict]:
    """One row per B with llama.cpp's raw figures (S_TG, S_PP, times), the command and
    commit; or one row whose status says what failed."""
    if not Path(binary).is_file():
        raise ConfigError("llama_batched_bench", str(binary), "give the path of a built llama-batched-bench binary "
                          "(../shared/peers/llama-cpp-cuda/build_on_gpu.sh builds one)")
    cmd = batched_bench_command(binary, model_path, prompt_tokens, decode_tokens, npl)
    base = {"engine": "llama.cpp-cuda", "bench": "llama-batched-bench", "command": " ".join(cmd),
            "llama_cpp_commit": os.environ.get("LLAMA_CPP_COMMIT", "unknown")}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [{**base, "status": f"failed: ran past {timeout:.0f} s"}]
    rows = parse_jsonl(proc.stdout) or parse_jsonl(proc.stderr)
    if proc.returncode != 0 or not rows:
        return [{**base, "status": f"failed: exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-300:]}"}]
    return [{**base, "status": "ok", "sequences": r["pl"], "prompt_tokens": r["pp"], "decode_tokens": r["tg"],
             "decode_tok_s": r["speed_tg"], "prefill_tok_s": r["speed_pp"], "raw": r} for r in rows]


def minivllm_batched_decode(llm, sequences: int, prompt_tokens: int = 128, decode_tokens: int = 128,
                            repeats: int = 3, seed: int = 0) -> dict:
    """minivllm's S_TG for `sequences` parallel sequences (see the module docstring): the
    median over `repeats` of B * (G - 1) / (t_G - t_1)."""
    import numpy as np
    import torch

    from minivllm.bench.offline import allowed_token_ids
    from minivllm.sampling.sampling_params import SamplingParams

    allowed = allowed_token_ids(llm.tokenizer, llm.config.vocab_size)
    rng = np.random.default_rng(seed)
    prompts = [rng.choice(allowed, size=prompt_tokens).tolist() for _ in range(sequences)]

    def timed(n_out: int) -> float:
        params = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
        dev = llm.model.device
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        dt = time.perf_counter() - t0
        got = sorted({len(o.token_ids) for o in outs})
        if got != [n_out]:
            raise RuntimeError(f"expected {n_out} tokens per sequence, got {got}")
        return dt

    timed(decode_tokens)  # warm-up: graphs captured, kernels compiled for these batch sizes
    samples = []
    for _ in range(repeats):
        t1 = timed(1)
        tg = timed(decode_tokens)
        samples.append(sequences * (decode_tokens - 1) / (tg - t1))
    samples.sort()
    return {"engine": "minivllm", "sequences": sequences, "prompt_tokens": prompt_tokens,
            "decode_tokens": decode_tokens, "decode_tok_s": samples[len(samples) // 2], "samples": samples}


def compare(model_path: str | Path, binary: str | None, *, npl: tuple[int, ...] = DEFAULT_NPL,
            prompt_tokens: int = 128, decode_tokens: int = 128, repeats: int = 3,
            engine_options: dict | None = None) -> dict:
    """Both engines on one file (minivllm first, then llama-batched-bench when `binary`):
    {"meta", "minivllm": rows, "llama_cpp": rows}, each minivllm row with the peer's S_TG
    and `ratio_vs_llama_cpp` for its B."""
    import torch

    from minivllm.engine.llm import LLM

    options = dict(engine_options or {})
    llm = LLM(str(model_path), device="cuda", dtype="float16", progress=False,
              max_model_len=prompt_tokens + decode_tokens + 8, max_active_requests=max(npl), **options)
    rows = []
    for b in npl:
        t0 = time.time()
        r = minivllm_batched_decode(llm, b, prompt_tokens, decode_tokens, repeats=repeats)
        print(f"minivllm B={b}: {r['decode_tok_s']:.1f} tok/s ({time.time() - t0:.0f} s)", flush=True)
        rows.append(r)
    del llm
    torch.cuda.empty_cache()
    peer = llama_batched_rows(binary, model_path, prompt_tokens, decode_tokens, npl) if binary else []
    by_b = {p["sequences"]: p for p in peer if p.get("status") == "ok"}
    for r in rows:
        p = by_b.get(r["sequences"])
        if p is not None:
            r["llama_cpp_decode_tok_s"] = p["decode_tok_s"]
            r["ratio_vs_llama_cpp"] = r["decode_tok_s"] / p["decode_tok_s"]
        print(
            f"B={r['sequences']}: minivllm {r['decode_tok_s']:.1f} tok/s, llama.cpp "
            f"{r.get('llama_cpp_decode_tok_s', float('nan')):.1f}, "
            f"ratio {r.get('ratio_vs_llama_cpp', float('nan')):.3f}",
            flush=True,
        )
    meta = {
        "device": torch.cuda.get_device_name(0),
        "model": str(model_path),
        "engine_options": options,
        "commit": os.environ.get("MINIVLLM_COMMIT", "unknown"),
        "env": {
            k: v
            for k, v in os.environ.items()
            if k in ("MINIVLLM_GPU_PROFILE", "MINIVLLM_Q8_GEMV", "MINIVLLM_GEMV_CONFIGS", "MINIVLLM_GEMV_KERNEL")
        },
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "minivllm_measure": "B random-token prompts of P tokens through LLM.generate (f16, greedy, EOS ignored); "
        "S_TG = B * (G - 1) / (t_G - t_1), median of the repeats after one warm-up",
        "llama_cpp_measure": "llama-batched-bench speed_tg = B * G / t_tg",
    }
    return {"meta": meta, "minivllm": rows, "llama_cpp": peer}

