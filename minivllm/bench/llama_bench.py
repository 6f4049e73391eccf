"""llama.cpp's own `llama-bench` as the GPU peer of `bench decode`, on the same file, in the same run.

`minivllm bench decode --llama-bench PATH` runs, after minivllm's rounds and in the same
process tree,

    PATH -m FILE -ngl 99 -p P -n N -d 0,P -r R -o json

so the peer reports prefill of the P-token prompt (pp P at depth 0) and N decode tokens
after the prompt (tg N at depth P): the same two things minivllm's row measures (a
P-token prompt, then N greedy tokens). Each peer row carries llama-bench's raw figures,
the command, and the llama.cpp commit (llama-bench's `build_commit`, or
$LLAMA_CPP_COMMIT where the build does not know it); minivllm's rows on a GPU get
`ratio_vs_llama_cpp` (decode) and `ratio_vs_llama_cpp_prefill`.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from minivllm.errors import ConfigError


def llama_bench_command(binary: str, model_path: str | Path, prompt_tokens: int, decode_tokens: int,
                        repetitions: int = 5) -> list[str]:
    return [str(binary), "-m", str(model_path), "-ngl", "99", "-p", str(prompt_tokens), "-n", str(decode_tokens),
            "-d", f"0,{prompt_tokens}", "-r", str(repetitions), "-o", "json"]


def llama_bench_rows(binary: str, model_path: str | Path, prompt_tokens: int, decode_tokens: int, *,
                     repetitions: int = 5, timeout: float = 900.0) -> list[dict]:
    """One `llama.cpp-cuda` row (raw llama-bench figures, command, commit), or a row with
    status 'failed: ...' naming what went wrong."""
    if not Path(binary).is_file():
        raise ConfigError("llama_bench", str(binary), "give the path of a built llama-bench binary "
                          "(../shared/peers/llama-cpp-cuda/build_on_gpu.sh builds one)")
    cmd = llama_bench_command(binary, model_path, prompt_tokens, decode_tokens, repetitions)
    base = {"engine": "llama.cpp-cuda", "device": "cuda", "dtype": "f16 KV", "prompt_tokens": prompt_tokens,
            "decode_tokens": decode_tokens, "llama_bench_command": " ".join(cmd)}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [{**base, "status": f"failed: llama-bench ran past {timeout:.0f} s"}]
    if proc.returncode != 0:
        return [{**base, "status": f"failed: llama-bench exit {proc.returncode}: {proc.stderr.strip()[-300:]}"}]
    try:
        tests = json.loads(proc.stdout)
        pp = next(t for t in tests if t["n_prompt"] == prompt_tokens and t["n_gen"] == 0 and t.get("n_depth", 0) == 0)
        tg = next(t for t in tests if t["n_prompt"] == 0 and t["n_gen"] == decode_tokens
                  and t.get("n_depth", 0) == prompt_tokens)
        tg0 = next((t for t in tests if t["n_prompt"] == 0 and t["n_gen"] == decode_tokens
                    and t.get("n_depth", 0) == 0), None)
    except (json.JSONDecodeError, StopIteration, KeyError, TypeError) as exc:
        return [
            {**base, "status": f"failed: unexpected llama-bench output ({type(exc).__name__}): {proc.stdout[:300]}"}
        ]
    commit = pp.get("build_commit") or "unknown"
    if commit == "unknown":
        commit = os.environ.get("LLAMA_CPP_COMMIT", "unknown")
    row = {**base, "status": "ok", "llama_cpp_commit": commit, "gpu_info": pp.get("gpu_info"),
           "prefill_tok_s_median": pp["avg_ts"], "prefill_tok_s": f"{pp['avg_ts']:.4g} ± {pp['stddev_ts']:.2g}",
           "decode_tok_s_median": tg["avg_ts"], "decode_tok_s": f"{tg['avg_ts']:.4g} ± {tg['stddev_ts']:.2g}",
           "runs": repetitions, "raw": {"pp": _raw(pp), "tg_after_prompt": _raw(tg)}}
    if tg0 is not None:
        row["decode_tok_s_from_empty_context"] = tg0["avg_ts"]
        row["raw"]["tg_from_empty"] = _raw(tg0)
    return [row]


def _raw(test: dict) -> dict:
    return {k: test[k] for k in ("n_prompt", "n_gen", "n_depth", "avg_ts", "stddev_ts", "avg_ns", "stddev_ns",
                                 "samples_ts", "model_filename", "model_size", "test_time") if k in test}


def add_ratios(rows: list[dict]) -> None:
    """`ratio_vs_llama_cpp` (decode) and `ratio_vs_llama_cpp_prefill` on every ok minivllm
    GPU row, against the ok llama.cpp-cuda row, whose raw figures the row repeats."""
    peer = next((r for r in rows if r.get("engine") == "llama.cpp-cuda" and r.get("status") == "ok"), None)
    if peer is None:
        return
    for r in rows:
        if (
            r.get("engine", "").startswith("minivllm")
            and r.get("status") == "ok"
            and str(r.get("device")).startswith("cuda")
        ):
            r["ratio_vs_llama_cpp"] = r["decode_tok_s_median"] / peer["decode_tok_s_median"]
            r["ratio_vs_llama_cpp_prefill"] = r["prefill_tok_s_median"] / peer["prefill_tok_s_median"]
            r["llama_cpp_decode_tok_s"] = peer["decode_tok_s_median"]
            r["llama_cpp_prefill_tok_s"] = peer["prefill_tok_s_median"]
            r["llama_cpp_commit"] = peer["llama_cpp_commit"]
            r["llama_cpp_command"] = peer["llama_bench_command"]
