"""GPU batched generation: minivllm's continuous-batching engine next to transformers' own
`generate` on the same GGUF file, the same prompts and the same batch sizes.

What a user comparing the two would run: B prompts of exactly `prompt_len` tokens each
(windows of data/prompts.json at different offsets, so no padding is involved and both
engines see identical inputs), greedy, exactly `decode_tokens` new tokens per prompt.

* minivllm: `LLM.generate(prompts)` on a fresh engine (`LLM.fork`) per measurement, its
  quantized weights dequantized inside the kernels, activations in `dtype`
  (f16 by default: T4 has no bf16), CUDA graphs as configured; EOS ignored
  (`ignore_eos`).
* transformers: `AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)`, i.e. the
  GGUF weights dequantized once into dense `dtype` tensors on the GPU, then
  `model.generate(input_ids, attention_mask, max_new_tokens=n, min_new_tokens=n,
  do_sample=False)` with its default dynamic KV cache. `min_new_tokens` keeps EOS from
  ending a row early (it masks EOS, which minivllm does not; the token agreement column
  shows where that matters).

Per batch size and engine: one warm-up, then `runs` timed runs with the engines taking
turns inside each run (more runs while the coefficient of variation of either engine's
output tok/s exceeds 5%, up to `max_runs`). Output tok/s = B * decode_tokens / wall time of
the whole generation (prefill included, with torch.cuda.synchronize before both clocks).
The ratio column is minivllm / transformers: > 1 means minivllm is faster.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

import torch

from minivllm.bench.common import (
    CV_TARGET,
    coefficient_of_variation,
    common_prefix,
    model_label,
    provenance,
    runs_until_stable,
    summarize,
)
from minivllm.bench.continuous_batching import PROMPTS_FILE
from minivllm.bench.decode import long_prompt_ids
from minivllm.bench.results import write_results
from minivllm.devices import resolve_device
from minivllm.engine.llm import LLM
from minivllm.errors import ConfigError
from minivllm.models.cache import sha256_file
from minivllm.sampling.sampling_params import SamplingParams

PROMPT_STRIDE = 7  # tokens between the starts of consecutive prompts' windows
TORCH_DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}


def batch_prompts(tokenizer, batch: int, prompt_len: int) -> list[list[int]]:
    """`batch` distinct prompts of exactly `prompt_len` ids (overlapping windows of one long text)."""
    ids = long_prompt_ids(tokenizer, prompt_len + PROMPT_STRIDE * batch)
    return [ids[b * PROMPT_STRIDE: b * PROMPT_STRIDE + prompt_len] for b in range(batch)]


class MinivllmBatched:
    engine = "minivllm"

    def __init__(self, llm: LLM):
        self.llm = llm

    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        engine_llm = self.llm.fork(max_active_requests=len(prompts))  # a fresh KV pool per measurement
        outs = engine_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        del engine_llm
        return [list(o.token_ids) for o in outs]


class TransformersBatched:
    engine = "transformers"

    def __init__(self, model_path: Path, device: torch.device, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name,
                                                          dtype=dtype, local_files_only=True).to(device).eval()
        cfg = self.model.generation_config
        eos = cfg.eos_token_id if cfg.eos_token_id is not None else self.model.config.eos_token_id
        self.pad_id = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        ids = torch.tensor(prompts, device=self.device)
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                  min_new_tokens=n, do_sample=False, pad_token_id=self.pad_id)
        return out[:, ids.shape[1]:].tolist()


def _timed(runner, prompts: list[list[int]], n: int, device: torch.device) -> tuple[float, list[list[int]]]:
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = runner.generate(prompts, n)
    torch.cuda.synchronize(device)
    wall = time.perf_counter() - t0
    if [len(o) for o in out] != [n] * len(prompts):
        raise RuntimeError(f"{runner.engine} returned lengths {[len(o) for o in out]}, expected {n} each")
    return wall, out


def run(model: str = "smollm2-135m", device: str = "cuda:0", dtype: str = "f16", *,
        batch_sizes: tuple[int, ...] = (1, 8, 32), prompt_len: int = 128, decode_tokens: int = 128, runs: int = 3,
        max_runs: int = 8, engine_options: dict | None = None) -> dict:
    """Write benchmarks/results/peers-gpu-<model>-<stamp>.{json,md}; returns {"rows", "files"}."""
    dev = resolve_device(device)
    if dev.type != "cuda":
        raise ConfigError("inference_device", device, "the batched-generation comparison runs on a CUDA device; "
                          "for the CPU use `minivllm bench peers` without --inference-device")
    if dtype not in TORCH_DTYPES:
        raise ConfigError("activation_dtype", dtype, f"expected one of {sorted(TORCH_DTYPES)}")
    if decode_tokens < 1 or prompt_len < 1 or runs < 1 or not batch_sizes or min(batch_sizes) < 1:
        raise ConfigError("batch_sizes/prompt_len/decode_tokens/runs", (batch_sizes, prompt_len, decode_tokens, runs),
                          "all must be >= 1")
    import transformers

    from minivllm.models import resolve_model

    model_path = Path(resolve_model(model, progress=False))
    max_len = prompt_len + PROMPT_STRIDE + decode_tokens + 8
    llm = LLM(str(model_path), device=str(dev), dtype=dtype, progress=False, max_model_len=max_len,
              max_batched_tokens=max(2048, prompt_len), **(engine_options or {}))
    ours, theirs = MinivllmBatched(llm), TransformersBatched(model_path, dev, TORCH_DTYPES[dtype])
    runners = (ours, theirs)
    max_runs = max(max_runs, runs)

    rows: list[dict] = []
    for batch in batch_sizes:
        prompts = batch_prompts(llm.tokenizer, batch, prompt_len)
        for r in runners:  # warm-up: kernels compiled, CUDA graphs captured for this batch size
            _timed(r, prompts, min(8, decode_tokens), dev)
        # Engines take turns inside every run; more runs while either one's CV exceeds 5%.
        stable = runs_until_stable(lambda prompts=prompts: [_timed(r, prompts, decode_tokens, dev) for r in runners],
                                   min_runs=runs, max_runs=max_runs, cv_target=CV_TARGET,
                                   key=lambda measured: [batch * decode_tokens / wall for wall, _ in measured])
        done = stable.runs
        walls = {r.engine: [m[i][0] for m in stable.samples] for i, r in enumerate(runners)}
        outs = {r.engine: stable.samples[-1][i][1] for i, r in enumerate(runners)}
        tps = {e: [batch * decode_tokens / w for w in ws] for e, ws in walls.items()}
        agree = [common_prefix(a, b) for a, b in zip(outs["minivllm"], outs["transformers"])]
        for r in runners:
            s = summarize(tps[r.engine])
            rows.append({"batch": batch, "engine": r.engine, "runs": done, "output_tok_s_mean": s["mean"],
                         "output_tok_s_std": s["std"], "output_tok_s_median": s["median"],
                         "output_tok_s_cv": coefficient_of_variation(tps[r.engine]),
                         "output tok/s (mean ± std)": f"{s['mean']:.4g} ± {s['std']:.2g}",
                         "wall_s_median": summarize(walls[r.engine])["median"],
                         "samples": {"output_tok_s": tps[r.engine], "wall_s": walls[r.engine]}})
        ours_row, their_row = rows[-2], rows[-1]
        ratio = ours_row["output_tok_s_mean"] / their_row["output_tok_s_mean"]
        for row in (ours_row, their_row):
            row["minivllm/transformers"] = ratio
            row["minivllm / transformers"] = f"{ratio:.2f}"
            row["greedy tokens shared (min, median over rows)"] = f"{min(agree)}, {sorted(agree)[len(agree) // 2]}"
        print(f"batch {batch}: minivllm {ours_row['output tok/s (mean ± std)']} tok/s, transformers "
              f"{their_row['output tok/s (mean ± std)']} tok/s, ratio {ratio:.2f}", flush=True)
        gc.collect()

    settings = {"model": model, "device": str(dev), "dtype": dtype, "batch_sizes": list(batch_sizes),
                "prompt_len": prompt_len, "decode_tokens": decode_tokens, "runs": runs, "max_runs": max_runs,
                "cv_target": CV_TARGET, "prompt_source": f"{PROMPTS_FILE.name}, windows {PROMPT_STRIDE} tokens apart",
                "sampling": "greedy; minivllm ignore_eos, transformers min_new_tokens=max_new_tokens",
                "warmup": "one run with min(8, decode_tokens) tokens per engine and batch size",
                "minivllm": {"engine_options": dict(engine_options or {}), "max_model_len": max_len,
                             "fresh_engine_per_run": True, "kernels": llm.snapshot().get("kernels")},
                "transformers": {"version": transformers.__version__,
                                 "load": "from_pretrained(dir, gguf_file=name): GGUF dequantized to dense weights",
                                 "generate": "max_new_tokens=min_new_tokens=n, do_sample=False, dynamic cache"}}
    meta = provenance(str(dev), sha256_file(model_path), settings)
    note = (f"Batched greedy generation on {meta['device']}: B prompts of exactly {prompt_len} tokens, "
            f"{decode_tokens} new tokens each, {dtype} activations for both engines. Output tok/s = B x "
            f"{decode_tokens} / wall time of the whole generation (prefill included). Mean ± sample std over the "
            f"runs column (engines take turns in every run; more runs while CV > {CV_TARGET:.0%}). minivllm runs the "
            f"quantized GGUF weights through its dequantizing kernels; transformers dequantizes the same file into "
            f"dense {dtype} weights at load, then runs its own `generate`.")
    cols = ["batch", "engine", "runs", "output tok/s (mean ± std)", "minivllm / transformers",
            "greedy tokens shared (min, median over rows)"]
    paths = write_results(f"peers-gpu-{model_label(model)}", meta, rows, cols, note)
    print(paths[1].read_text(), flush=True)
    return {"rows": rows, "files": [str(p) for p in paths]}
