"""The result table (one column per server, ratios against the first) and the result files."""

from __future__ import annotations

import json
import math
from pathlib import Path

from minivllm.bench.serve_load.metrics import RequestResult, request_metrics
from minivllm.bench.serve_load.workload import LoadSettings


def request_row(r: RequestResult) -> dict:
    row = {"index": r.index, "ok": r.ok, "error": r.error, "status": r.status, "input_len": r.input_len,
           "output_len": r.output_len, "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
           "tokens_from": r.tokens_from, "finish_reason": r.finish_reason, "send_s": r.send_s, "end_s": r.end_s,
           "chunk_s": r.chunk_s, "ttft_s": None, "e2e_s": None, "tpot_s": None}
    if r.ok:
        m = request_metrics(r.send_s, r.chunk_s, r.end_s, r.output_tokens)
        row.update(ttft_s=m["ttft_s"], e2e_s=m["e2e_s"], tpot_s=m["tpot_s"])
    return row


def notes(s: LoadSettings, n: int, url: str, model: str | None, exact: bool) -> str:
    arrival = (f"bursts of {s.burst_size} every {s.burst_gap_s} s" if s.arrival == "burst" else
               "all at once" if math.isinf(s.request_rate) else f"Poisson at {s.request_rate:g} req/s")
    lens = (f"input {'%d:%d' % s.input_len_range if s.input_len_range else s.input_len} tokens"
            f" ({'exact' if exact else 'approximate'}), output "
            f"{'%d:%d' % s.output_len_range if s.output_len_range else s.output_len} tokens")
    slo = ", ".join(x for x in (f"TTFT <= {s.slo_ttft_ms:g} ms" if s.slo_ttft_ms is not None else "",
                                f"TPOT <= {s.slo_tpot_ms:g} ms" if s.slo_tpot_ms is not None else "") if x)
    return (f"{n} streamed requests to /v1/{'chat/completions' if s.endpoint == 'chat' else 'completions'} of {url} "
            f"(model {model}); {arrival}; max concurrency {s.max_concurrency or 'unlimited'}; {lens}; "
            f"temperature {s.temperature:g}; ignore_eos {'on' if s.ignore_eos else 'off'}; seed {s.seed}"
            + (f"; SLOs {slo}" if slo else "") + ".")


ROWS = [("successful requests", "completed", "{:d}"), ("failed requests", "failed", "{:d}"),
        ("duration (s)", "duration_s", "{:.2f}"), ("total input tokens", "total_input_tokens", "{:d}"),
        ("total output tokens", "total_output_tokens", "{:d}"),
        ("request throughput (req/s)", "request_throughput", "{:.3f}"),
        ("output token throughput (tok/s)", "output_throughput", "{:.1f}"),
        ("total token throughput (tok/s)", "total_token_throughput", "{:.1f}"),
        ("goodput (req/s)", "goodput", "{:.3f}")]


LATENCIES = [("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")]


def _rows(summary: dict) -> list[tuple[str, float | int | None, str]]:
    rows = [(name, summary.get(key), fmt) for name, key, fmt in ROWS
            if key != "goodput" or summary.get("goodput") is not None]
    for name, key in LATENCIES:
        for stat in ("mean", "median", "p99", "std"):
            rows.append((f"{name} {stat} (ms)", summary[key][stat], "{:.2f}"))
    return rows


def table(targets: list[dict]) -> str:
    """One Markdown table: a column per target, then (with several) a ratio column per target vs the first."""
    labels = [t["label"] for t in targets]
    rows = [_rows(t["summary"]) for t in targets]
    head = ["metric"] + labels + [f"{lb} / {labels[0]}" for lb in labels[1:]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    names = [r[0] for r in rows[0]]
    for name in names:
        cells = [name]
        values = []
        for rs in rows:
            match = [r for r in rs if r[0] == name]
            v, fmt = (match[0][1], match[0][2]) if match else (None, "")
            values.append(v)
            cells.append(
                "" if v is None else fmt.format(v) if not (fmt == "{:d}" and isinstance(v, float)) else f"{v:g}"
            )
        for v in values[1:]:
            base = values[0]
            cells.append(f"{v / base:.3f}" if isinstance(v, (int, float)) and isinstance(base, (int, float)) and base
                         else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(targets: list[dict]) -> str:
    title = "serve: " + " vs ".join(t["label"] for t in targets)
    lines = [f"# {title}", ""]
    for t in targets:
        lines += [f"- **{t['label']}**: {t['notes']}", ""]
    lines += [table(targets), ""]
    s0 = targets[0]["summary"]
    lines += [f"Latencies in ms over the successful requests (ITL pooled over them); input tokens from "
              f"{s0['input_tokens_from']}, output tokens from {s0['output_tokens_from']}. "
              "TTFT = first content chunk - send; TPOT = (E2E - TTFT) / (output tokens - 1); "
              "ITL = gaps between content chunks; E2E = end of stream - send.", ""]
    for t in targets:
        s = t["summary"]
        if s.get("output_len_mismatch"):
            lines += [f"{t['label']}: {s['output_len_mismatch']} requests returned a different number of output "
                      "tokens than requested (the server may not honour ignore_eos).", ""]
        if s["errors"]:
            lines += [f"{t['label']}: failures (first {len(s['errors'])} kinds):", ""]
            lines += [f"- {e['count']} x `{e['error'][:200]}`" for e in s["errors"]] + [""]
    lines += ["Provenance:", "", "```json", json.dumps(targets[0]["provenance"], indent=2, default=str), "```", ""]
    for t in targets:
        tg = t["target"]
        lines += [f"Server `{t['label']}`: {tg['url']}, /v1/models:", "", "```json",
                  json.dumps(tg.get("v1_models"), indent=2, default=str)[:4000], "```", ""]
    return "\n".join(lines)


def write_files(out: Path, name: str, data: dict, md: str) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"{name}.json", out / f"{name}.md"
    json_path.write_text(json.dumps(data, indent=2, default=str))
    md_path.write_text(md)
    return json_path, md_path
