"""CPU prefill and decode speed of minivllm next to its peers on the same GGUF file.

Engines: minivllm (`LLM`, f32 activations, default kernel options; with dtypes=("f32",
"bf16") also its fast mode, a second row), transformers
(`AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)` in float32 with its KV cache)
and, when the `llama_cpp` module imports, llama-cpp-python ("not installed" otherwise;
nothing is built). All run on the CPU with the same thread count, in the same process,
taking turns inside every run, so each ratio compares numbers measured next to each other.

Every engine gets the same `prompt_len` token ids (cut from data/prompts.json) and then
decodes `decode_tokens` greedy tokens one at a time with its KV cache (EOS ignored):

* prefill tok/s = prompt tokens / (prompt given -> first token chosen): one forward over
  the whole prompt plus one argmax (minivllm: from its RequestMetrics, queue time excluded);
* decode tok/s = (decode_tokens - 1) / (first token -> last token).

The engine runners are those of `minivllm bench decode` (minivllm/bench/decode.py); this
driver fixes the setting (CPU, f32, all cores by default) and reports ratios vs minivllm
and how many greedy tokens each engine shares with minivllm (f32 engines on the same file
should agree for a good while: evidence that they ran the same model).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from minivllm.bench.common import (
    CV_TARGET,
    common_prefix,
    loadavg,
    model_label,
    provenance,
    record_stat,
    runs_until_stable,
)
from minivllm.bench.decode import (
    PROMPTS_FILE,
    LlamaCppRunner,
    MinivllmRunner,
    TransformersRunner,
    load_llama_cpp,
    long_prompt_ids,
)
from minivllm.bench.results import write_results
from minivllm.errors import ConfigError
from minivllm.models.cache import sha256_file

PREFILL_COL = "prefill tok/s (mean ± std)"
DECODE_COL = "decode tok/s (mean ± std)"
PREFILL_RATIO_COL = "prefill ratio vs minivllm"
DECODE_RATIO_COL = "decode ratio vs minivllm"
AGREE_COL = "greedy tokens equal to minivllm's"
VS_LLAMA_COL = "prefill / decode vs llama.cpp"


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def run(model: str = "smollm2-135m", *, prompt_len: int = 128, decode_tokens: int = 64, runs: int = 3,
        threads: int | None = None, llama_cpp_path: str | None = None, engine_options: dict | None = None,
        max_runs: int = 8, dtypes: tuple[str, ...] = ("f32",)) -> dict:
    """Measure every available engine; write benchmarks/results/peers-<model>-<stamp>.{json,md}.
    Returns {"rows": [...], "table": markdown table, "files": [json, md]}."""
    if decode_tokens < 2:
        raise ConfigError("decode_tokens", decode_tokens, "must be >= 2 (decode speed needs tokens after the first)")
    if prompt_len < 1 or runs < 1:
        raise ConfigError("prompt_len" if prompt_len < 1 else "runs", min(prompt_len, runs), "must be >= 1")
    from minivllm.models import resolve_model

    model_path = Path(resolve_model(model, progress=False))
    threads = threads or default_threads()
    torch.set_num_threads(threads)
    load_start = loadavg()
    max_len = prompt_len + decode_tokens + 8

    for dt in dtypes:
        if dt not in ("f32", "bf16"):
            raise ConfigError("activation_dtype", dt, "on the CPU: f32 (exact) or bf16 (the fast mode)")
    ours = [MinivllmRunner(model_path, "cpu", dt, max_len, prompt_len, engine_options) for dt in dtypes]
    for r in ours[1:] if dtypes[0] == "f32" else ours:
        if r.dtype != "f32":
            r.engine = f"minivllm {r.dtype} (fast mode)"
    runners: list = list(ours)
    rows_skipped: list[dict] = []
    versions: dict[str, str] = {}
    import transformers

    runners.append(TransformersRunner(model_path))
    versions["transformers"] = transformers.__version__
    lib, why = load_llama_cpp(llama_cpp_path)
    if lib is None:
        rows_skipped.append({"engine": "llama.cpp (llama-cpp-python)", "status": why})
        versions["llama_cpp_python"] = why
    else:
        runners.append(LlamaCppRunner(lib, model_path, threads, max_len, prompt_len))
        versions["llama_cpp_python"] = getattr(lib, "__version__", "?")

    ids = long_prompt_ids(ours[0].llm.tokenizer, prompt_len)
    for r in runners:  # warm-up: caches allocated, pages touched, kernels chosen
        r.measure(ids, min(4, decode_tokens))
    def one_round() -> list[tuple[float, float, list[int]]]:  # engines take turns inside every round
        measured = [r.measure(ids, decode_tokens) for r in runners]
        print("run: " + ", ".join(f"{r.engine} prefill {prompt_len / tp:.1f} decode {(decode_tokens - 1) / td:.1f} "
                                   f"tok/s" for r, (tp, td, _) in zip(runners, measured)), flush=True)
        return measured

    # At least `runs` rounds, more while any engine's prefill or decode tok/s has a CV above 5%.
    rounds = runs_until_stable(one_round, min_runs=runs, max_runs=max(max_runs, runs), cv_target=CV_TARGET,
                               key=lambda m: [prompt_len / tp for tp, _, _ in m]
                               + [(decode_tokens - 1) / td for _, td, _ in m])
    prefill = [[prompt_len / m[i][0] for m in rounds.samples] for i in range(len(runners))]
    decode = [[(decode_tokens - 1) / m[i][1] for m in rounds.samples] for i in range(len(runners))]
    tokens = [rounds.samples[-1][i][2] for i in range(len(runners))]

    rows = []
    for i, r in enumerate(runners):
        row = {"engine": r.engine, "status": "ok", "dtype": r.dtype, "threads": threads, "prompt_tokens": prompt_len,
               "decode_tokens": decode_tokens, "runs": rounds.runs}
        record_stat(row, "prefill_tok_s", prefill[i], column=PREFILL_COL)
        record_stat(row, "decode_tok_s", decode[i], column=DECODE_COL)
        row["greedy_tokens"] = tokens[i]
        row[AGREE_COL] = common_prefix(tokens[i], tokens[0])
        row["samples"] = {"prefill_tok_s": prefill[i], "decode_tok_s": decode[i]}
        rows.append(row)
    base = rows[0]
    llama = next((row for row in rows if row["engine"] == "llama.cpp"), None)
    for row in rows:
        row["prefill_vs_minivllm"] = row["prefill_tok_s_mean"] / base["prefill_tok_s_mean"]
        row["decode_vs_minivllm"] = row["decode_tok_s_mean"] / base["decode_tok_s_mean"]
        row[PREFILL_RATIO_COL] = f"{row['prefill_vs_minivllm']:.2f}"
        row[DECODE_RATIO_COL] = f"{row['decode_vs_minivllm']:.2f}"
        if llama is not None:  # the view: each engine / llama.cpp
            row["prefill_vs_llama_cpp"] = row["prefill_tok_s_mean"] / llama["prefill_tok_s_mean"]
            row["decode_vs_llama_cpp"] = row["decode_tok_s_mean"] / llama["decode_tok_s_mean"]
            row[VS_LLAMA_COL] = f"{row['prefill_vs_llama_cpp']:.2f} / {row['decode_vs_llama_cpp']:.2f}"
    for r, row in zip(ours, rows):
        row["kernels"] = r.kernels()
        row["engine_options"] = dict(engine_options or {})
    rows += rows_skipped

    settings = {
        "model": model,
        "device": "cpu",
        "prompt_len": prompt_len,
        "decode_tokens": decode_tokens,
        "runs": runs,
        "max_runs": max(max_runs, runs),
        "rounds": rounds.info(),
        "threads": threads,
        "torch_threads": torch.get_num_threads(),
        "sampling": "greedy (argmax), EOS ignored",
        "prompt_source": PROMPTS_FILE.name,
        "warmup": f"one {min(4, decode_tokens)}-token run per engine",
        "minivllm": {
            "dtypes": list(dtypes),
            "engine_options": dict(engine_options or {}),
            "kernels": {r.engine: r.kernels() for r in ours},
        },
        "transformers": {"dtype": "float32", "load": "AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)"},
        **{f"{k}_version": v for k, v in versions.items()},
    }
    meta = provenance("cpu", sha256_file(model_path), settings)
    meta["load_average_1_5_15"] = {"start": load_start, "end": loadavg()}
    gemv = "".join(f"{r.engine} kernels: gemv_max_rows={k.get('gemv_max_rows')}, GEMV kinds {k.get('gemv_kinds')}. "
                   for r in ours if isinstance(k := r.kernels(), dict))
    gemv += "Decode rows take the GEMV path; the prompt's rows take GEMM. " if gemv else ""
    note = (f"CPU, {threads} threads for every engine, same GGUF file ({model_path.name}), same {prompt_len} prompt "
            f"token ids, then {decode_tokens} greedy tokens one at a time with the KV cache. prefill tok/s = prompt "
            f"tokens / (prompt -> first token); decode tok/s = ({decode_tokens} - 1) / (first -> last token). Mean ± "
            f"sample std over {rounds.runs} runs after a warm-up (at least {runs}, more while a CV exceeded "
            f"{CV_TARGET:.0%}; stopped: {rounds.stopped}); engines take turns within each run; ratios are of means "
            f"(engine / minivllm; > 1: faster than minivllm). {gemv}Load average (1/5/15 min) at start {load_start}, "
            f"end {meta['load_average_1_5_15']['end']}.")
    cols = ["engine", "status", PREFILL_COL, DECODE_COL, PREFILL_RATIO_COL, DECODE_RATIO_COL, VS_LLAMA_COL, AGREE_COL]
    paths = write_results(f"peers-{model_label(model)}", meta, rows, cols, note)
    md = paths[1].read_text()
    print(md, flush=True)
    table = md[md.index("| engine"):md.index("\nProvenance:")].strip()
    return {"rows": rows, "table": table, "files": [str(p) for p in paths]}
