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
