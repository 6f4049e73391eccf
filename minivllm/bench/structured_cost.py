"""What structured output costs at decode: batches of 1 and 16 rows, unconstrained, every row
under a JSON schema, and (at 16) every row under its own variant of the schema and half
the rows constrained, on the same model and device.

    minivllm bench structured [--model M | --synthetic qwen2.5-0.5b-q4_k_m] [--inference-device gpu]

Every row gets its own short prompt (no prefix sharing) and decodes exactly `max_tokens`
tokens: unconstrained rows ignore EOS, and the schema (an object holding at least 64 small
records) cannot be complete sooner. Under one shared schema the rows reach its keys in
the same steps; "each row its own" varies the key names and the names' bound per row, so
they drift apart as a real mix of requests would. Decode tok/s of a batch = tokens after
each row's first / (last row's end - first token), from the engine's own request metrics,
the end pushed back by whatever device work was still queued when the batch returned: a
step whose rows all take tokens the grammar forces never waits for the GPU, so the host
may finish ahead of it. The modes take turns inside every round, so each ratio compares
numbers measured next to each other.

"plain rows in a mixed batch" answers whether a constraint costs the unconstrained rows
that share its batch anything: their per-row tok/s next to that of an all-plain batch.
"""

from __future__ import annotations

import statistics
import time

import torch

from minivllm.bench.common import model_label, provenance
from minivllm.bench.results import write_results
from minivllm.engine.llm import LLM
from minivllm.sampling.sampling_params import SamplingParams

LONG_SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "minItems": 64, "items": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                       "name": {"type": "string", "minLength": 1, "maxLength": 12}},
        "required": ["id", "name"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False,
}


# The same records with free-length names: no length to track inside strings, so the
# mask there is cheaper to compute (llguidance's slices cover it).
FREE_SCHEMA = {**LONG_SCHEMA, "properties": {"items": {**LONG_SCHEMA["properties"]["items"], "items": {
    **LONG_SCHEMA["properties"]["items"]["items"],
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "name": {"type": "string"}}}}}}


def row_schema(row: int) -> dict:
    """Row `row`'s own variant of LONG_SCHEMA: other key names and another bound on the
    names. Under one shared schema a batch's rows reach the same kind of position (forced
    keys, numbers, strings) in the same steps; under these they drift apart, as the rows of
    a real mix of requests do."""
    id_key, name_key = ("id", "sku", "code", "number")[row % 4], ("name", "title", "label")[row % 3]
    record = {"type": "object",
              "properties": {id_key: {"type": "integer", "minimum": 0, "maximum": 999},
                             name_key: {"type": "string", "minLength": 1, "maxLength": 6 + row % 9}},
              "required": [id_key, name_key], "additionalProperties": False}
    return {**LONG_SCHEMA, "properties": {"items": {**LONG_SCHEMA["properties"]["items"], "items": record}}}


PER_ROW = "json_schema, each row its own"
SCHEMAS = {"json_schema, every row": LONG_SCHEMA, "json_schema (free-length strings), every row": FREE_SCHEMA,
           "json_schema, half the rows": LONG_SCHEMA}


def modes(batch: int) -> tuple[str, ...]:
    every = ("unconstrained", "json_schema, every row", "json_schema (free-length strings), every row")
    return every if batch == 1 else every + (PER_ROW, "json_schema, half the rows")


def _schema(mode: str, row: int) -> dict:
    return row_schema(row) if mode == PER_ROW else SCHEMAS[mode]


def _params(mode: str, batch: int, max_tokens: int) -> list[SamplingParams]:
    constrained = 0 if mode == "unconstrained" else batch // 2 if "half" in mode else batch
    return [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                           structured={"json_schema": _schema(mode, i)} if i < constrained else None)
            for i in range(batch)]


def _measure(llm: LLM, mode: str, batch: int, max_tokens: int, round_no: int) -> dict:
    params = _params(mode, batch, max_tokens)
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content":
               f"Request {round_no}-{i}: list sixty-four products with an id and a short name, as JSON."}])
               for i in range(batch)]
    counts = dict(llm.engine.constraints.counts)
    outs = llm.generate(prompts, params)
    returned = time.perf_counter()
    device = llm.engine.model.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    device_tail = time.perf_counter() - returned  # the GPU still working after the host finished
    draws = {k: v - counts[k] for k, v in llm.engine.constraints.counts.items()}
    first = max(o.metrics.time_to_first_token_s for o in outs)
    end = max(o.metrics.e2e_s for o in outs) + device_tail
    tokens = sum(len(o.token_ids) - 1 for o in outs)
    plain = [o for o, p in zip(outs, params) if p.structured is None]
    per_row_plain = statistics.fmean((len(o.token_ids) - 1) / (o.metrics.e2e_s - o.metrics.time_to_first_token_s)
                                     for o in plain) if plain else None
    short = [len(o.token_ids) for o in outs if len(o.token_ids) != max_tokens]
    failed = [o.error for o in outs if o.finish_reason == "error"]
    if failed:  # counted in the table; the reason is worth seeing at once
        print(f"{mode}, batch {batch}: {len(failed)} rows failed, the first with: {failed[0]}", flush=True)
    return {"tok_s": tokens / (end - first), "plain_row_tok_s": per_row_plain, "short_rows": short,
            "errors": sum(o.finish_reason == "error" for o in outs), "draws": draws}


def run(model: str, device: str, *, max_tokens: int = 64, runs: int = 3, batches=(1, 16),
        synthetic: str | None = None, synthetic_tokenizer: str | None = None, dtype: str | None = None,
        engine_options: dict | None = None) -> tuple:
    from minivllm.models.cache import sha256_file

    path = model
    if synthetic is not None:
        from minivllm.bench.synthetic_model import ensure_synthetic_model

        path = str(ensure_synthetic_model(synthetic, tokenizer_source=synthetic_tokenizer))
    dtype = dtype or ("float32" if device == "cpu" else "float16")
    options = {"prefix_cache": False, "max_active_requests": max(batches), **(engine_options or {})}
    llm = LLM(path, device=device, dtype=dtype, progress=False, max_model_len=max_tokens + 128, **options)
    # Warm-up rounds as long as the measured ones: kernels, CUDA graphs, llguidance's
    # vocabulary view and the caches its first strings fill. An 8-token warm-up never
    # reached a string, and the first measured round of the bounded schema then ran
    # ~20% slower than the rest on the H200.
    for batch in batches:
        for mode in modes(batch):
            _measure(llm, mode, batch, max_tokens, -1)
    samples: dict[tuple[int, str], list[dict]] = {}
    for r in range(runs):
        for batch in batches:
            for mode in modes(batch):
                m = _measure(llm, mode, batch, max_tokens, r)
                samples.setdefault((batch, mode), []).append(m)
                print(f"round {r} batch {batch} {mode}: {m['tok_s']:.1f} tok/s", flush=True)
    rows = []
    for batch in batches:
        base = statistics.median(m["tok_s"] for m in samples[(batch, "unconstrained")])
        base_plain = statistics.median(m["plain_row_tok_s"] for m in samples[(batch, "unconstrained")])
        for mode in modes(batch):
            ms = samples[(batch, mode)]
            rates = [m["tok_s"] for m in ms]
            plain = [m["plain_row_tok_s"] for m in ms if m["plain_row_tok_s"] is not None]
            draws = {k: sum(m["draws"][k] for m in ms) for k in ms[0]["draws"]}
            total = sum(draws.values())
            rows.append(
                {
                    "batch": batch,
                    "mode": mode,
                    "decode_tok_s_median": statistics.median(rates),
                    "decode_tok_s_mean": statistics.fmean(rates),
                    "decode_tok_s_std": statistics.stdev(rates) if len(rates) > 1 else 0.0,
                    "vs_unconstrained": statistics.median(rates) / base,
                    "plain_row_tok_s_median": statistics.median(plain) if plain else None,
                    "plain_row_vs_all_plain": statistics.median(plain) / base_plain if plain else None,
                    "short_rows": sum(len(m["short_rows"]) for m in ms),
                    "errors": sum(m["errors"] for m in ms),
                    # How the constrained tokens were drawn (constrained_draw.py): forced by the
                    # grammar (no mask, no argmax) / masked beside the forward / masked at the
                    # draw / settled by checking candidate tokens.
                    "draws_forced_ahead_atdraw_checked": "/".join(f"{draws[k] / total:.2f}" for k in draws)
                    if total
                    else "-",
                }
            )
    label = model_label(synthetic or model)
    settings = {"bench": "structured", "model": label, "device": device, "dtype": dtype, "max_tokens": max_tokens,
                "runs": runs, "batches": list(batches), "engine_options": options,
                "schemas": {**SCHEMAS, PER_ROW: [row_schema(i) for i in range(max(batches))]},
                "sampling": "greedy, ignore_eos"}
    paths = write_results(
        f"structured-{label}-{device.replace(':', '')}",
        provenance(device, sha256_file(llm.model_path), settings),
        rows,
        [
            "batch",
            "mode",
            "decode_tok_s_median",
            "decode_tok_s_mean",
            "decode_tok_s_std",
            "vs_unconstrained",
            "plain_row_tok_s_median",
            "plain_row_vs_all_plain",
            "short_rows",
            "errors",
            "draws_forced_ahead_atdraw_checked",
        ],
        notes=__doc__.split("\n\n")[2] + "\n\n" + __doc__.split("\n\n")[3],
    )
    print(*paths)
    return paths
