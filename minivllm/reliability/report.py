"""The soak's result files (soak-<tag>-<stamp>.json and .md) and its printed summary."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from minivllm.reliability.workload import OUTCOMES


def device_tag(devices: list[str]) -> str:
    """["cpu:1", "cpu:1"] -> "cpu-2x1"; other mixes joined with '+'."""
    c = Counter(devices)
    if len(c) == 1:
        d = devices[0]
        kind, _, n = d.partition(":")
        return f"{kind}-{len(devices)}x{n}" if n else f"{kind}-{len(devices)}x"
    return "+".join(d.replace(":", "") for d in devices)


def write_result(result: dict, out_dir: Path, name: str) -> tuple[Path, Path]:
    import datetime as _dt

    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    json_path, md_path = out_dir / f"{name}-{stamp}.json", out_dir / f"{name}-{stamp}.md"
    json_path.write_text(json.dumps(result, indent=2, default=str))
    md_path.write_text(markdown(result))
    return json_path, md_path


def _f(v, digits: int = 3) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return "nan" if v != v else f"{v:.{digits}g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def markdown(result: dict) -> str:
    s = result["summary"]
    lines = [
        f"# {result['benchmark']}",
        "",
        result.get("notes", ""),
        "",
        f"**{'PASS' if result['ok'] else 'FAIL'}**: {sum(c['ok'] for c in result['checks'])}/"
        f"{len(result['checks'])} checks pass. {s['requests']} requests"
        + (
            f" (of {s['requests_planned']} planned: sending stopped at max_duration_s)"
            if s["requests"] < s["requests_planned"]
            else ""
        )
        + f" in {s['load_s']:.0f} s "
        f"({s['requests_per_s']:.2f} req/s)"
        + (f"; server start {s['server_start_s']} s." if s["server_start_s"] else "."),
        "",
        "## How the requests ended (client side)",
        "",
        "| ending | count | streamed | chat |",
        "|---|---|---|---|",
    ]
    for k in OUTCOMES:
        c = result["client"]["by_outcome"].get(k, 0)
        st = result["client"]["by_outcome_streamed"].get(k, 0)
        ch = result["client"]["by_outcome_chat"].get(k, 0)
        lines.append(f"| {k} | {c} | {st} | {ch} |")
    lines += [
        "",
        "Planned actions: "
        + ", ".join(f"{k} {v}" for k, v in sorted(result["client"]["by_action"].items()))
        + "; how they ended: "
        + json.dumps(result["client"]["action_x_outcome"]),
        "",
        "Cancel landed: " + json.dumps(result["client"]["cancel_phase"]),
        "",
        "## Server ledger (delta over the run)",
        "",
        "| submitted | " + " | ".join(sorted(result["server"]["ended"])) + " | open | duplicate_terminals |",
        "|---" * (3 + len(result["server"]["ended"])) + "|",
        f"| {result['server']['submitted']} | "
        + " | ".join(str(v) for _, v in sorted(result["server"]["ended"].items()))
        + f" | {result['server']['open']} | {result['server']['duplicate_terminals']} |",
        "",
        "| worker | state | routed | stop | length | abort | error | prefill tokens | decode tokens | preemptions "
        "| pages (final) | prefix hits / lookups | evicted pages |",
        "|---" * 13 + "|",
    ]
    for name, w in result["server"]["per_worker"].items():
        e, c, pc = w.get("engine_counters") or {}, w.get("counters") or {}, w.get("prefix_cache") or {}
        lines.append(f"| {name} | {w.get('state')} | {c.get('routed')} | {e.get('finished_stop')} | "
                     f"{e.get('finished_length')} | {e.get('finished_abort')} | {e.get('finished_error')} | "
                     f"{e.get('prefill_tokens')} | {e.get('decode_tokens')} | {e.get('preemptions')} | "
                     f"{', '.join(f'{k} {v}' for k, v in sorted(w.get('page_states', {}).items()))} of "
                     f"{w.get('total_pages')} | {pc.get('hits')} / {pc.get('lookups')} | {pc.get('evicted_pages')} |")
    lines += ["", "(Worker and engine counters are totals since the workers started.)", "",
              "## Latency and throughput (finished requests)", "", "| measure | value |", "|---|---|"]
    for k, v in s.items():
        if k not in ("requests",):
            lines.append(f"| {k} | {_f(v, 4)} |")
    lines += [
        "",
        "## RSS (MB): first vs last quarter of the load",
        "",
        "| process | samples | first quarter | last quarter | delta | ratio | max |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in result["rss"].items():
        lines.append(f"| {name} | {r['samples']} | {_f(r['first_quarter_mb'], 4)} | {_f(r['last_quarter_mb'], 4)} | "
                     f"{_f(r['delta_mb'], 3)} | {_f(r['ratio'], 4)} | {_f(r['max_mb'], 4)} |")
    lines += ["", "## Checks", "", "| check | ok | detail |", "|---|---|---|"]
    for c in result["checks"]:
        lines.append(f"| {c['name']} | {'yes' if c['ok'] else '**NO**'} | {c['detail'].replace('|', '/')[:300]} |")
    if result.get("failures"):
        lines += ["", "## Failed requests (first 20)", "", "```json",
                  json.dumps(result["failures"][:20], indent=1, default=str)[:8000], "```"]
    lines += ["", "Provenance:", "", "```json", json.dumps(result["provenance"], indent=2, default=str), "```", ""]
    return "\n".join(lines)


def print_summary(result: dict) -> None:
    s = result["summary"]
    print(f"\nsoak: {'PASS' if result['ok'] else 'FAIL'}: {s['requests']} requests in {s['load_s']} s "
          f"({s['requests_per_s']:.2f} req/s, {s['finished_completion_tok_per_s']:.1f} finished tok/s, engine decode "
          f"{s['engine_decode_tok_per_s']:.1f} tok/s); e2e p50 {_f(s['e2e_p50_s'])} s p99 {_f(s['e2e_p99_s'])} s; "
          f"stream TTFT p50 {_f(s['ttft_p50_stream_s'])} s p99 {_f(s['ttft_p99_stream_s'])} s")
    print("  client: " + ", ".join(f"{k} {v}" for k, v in result["client"]["by_outcome"].items()))
    srv = result["server"]
    print(f"  server: submitted {srv['submitted']}, ended {srv['ended']}, open {srv['open']}, "
          f"duplicate terminals {srv['duplicate_terminals']}")
    for name, r in result["rss"].items():
        print(f"  rss {name}: {r['first_quarter_mb']:.1f} -> {r['last_quarter_mb']:.1f} MB "
              f"({r['delta_mb']:+.1f} MB, x{r['ratio']:.3f}), max {r['max_mb']:.1f} MB, {r['samples']} samples")
    for c in result["checks"]:
        print(f"  [{'ok' if c['ok'] else 'FAIL'}] {c['name']}: {c['detail'][:200]}")
    for f in result.get("files", []):
        print(f"  wrote {f}")
    sys.stdout.flush()
