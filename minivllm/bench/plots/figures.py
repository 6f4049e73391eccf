"""FIGURES: every figure `bench plot` draws, each with the test of the result files it can draw and
its drawing function (matplotlib Figure, result data) -> a footer note."""

from __future__ import annotations

import textwrap

from minivllm.bench.plots.sources import Figure, mean_std, ordered, rows_of, rows_with, to_ms, to_number


def _lines(ax, series: dict[str, list[tuple[float, float, float | None]]]) -> None:
    """One line per label through (x, y, std) points, std drawn as error bars."""
    for label, points in series.items():
        if not points:
            continue
        points = sorted(points)
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        errs = [p[2] or 0.0 for p in points]
        ax.errorbar(xs, ys, yerr=errs if any(errs) else None, marker="o", markersize=4, capsize=3, label=label)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def _bars(ax, groups: list[str], series: dict[str, list[tuple[float | None, float | None]]],
          annotate: dict[str, list[str | None]] | None = None) -> None:
    """Grouped bars: one group per x label, one bar per series label; (value, std) per
    group, value None for a missing bar. `annotate` puts a short text over each bar."""
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        heights = [v if v is not None else 0.0 for v, _ in values]
        errs = [e or 0.0 for _, e in values]
        bars = ax.bar(xs, heights, width, yerr=errs if any(errs) else None, capsize=3, label=label)
        for bar, err, text in zip(bars, errs, (annotate or {}).get(label, [])):
            if text:  # above the error bar, not through it
                ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height() + err), xytext=(0, 2),
                            textcoords="offset points", ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=8)


# ------------------------------------------------------------------ the figures

_GEMV_MODES = (("sequential", "unbatched (one request at a time)"), ("gemm", "batched, GEMM"),
               ("gemv", "batched, row-wise GEMV"), ("batch_invariant", "batched, batch-invariant"))


def _draw_gemv_threshold(fig, data: dict) -> None:
    ax = fig.subplots()
    rows = rows_with(data, "concurrency")
    _lines(ax, {label: [(r["concurrency"], *mean_std(r, f"{mode}_tok_s")) for r in rows
                        if to_number(r.get(f"{mode}_tok_s_mean")) is not None]
                for mode, label in _GEMV_MODES})
    ax.set_xlabel("concurrent requests N")
    ax.set_ylabel("aggregate output tokens/s")
    ax.set_ylim(bottom=0)


def _draw_continuous_batching(fig, data: dict) -> None:
    ax = fig.subplots()
    rows = rows_with(data, "concurrency", "batched_tok_s_mean")
    _lines(ax, {"batched (continuous batching)": [(r["concurrency"], *mean_std(r, "batched_tok_s")) for r in rows],
                "sequential (one request at a time)": [(r["concurrency"], *mean_std(r, "sequential_tok_s"))
                                                       for r in rows]})
    ax.set_xlabel("concurrent requests N")
    ax.set_ylabel("aggregate output tokens/s")
    ax.set_ylim(bottom=0)


def _draw_paged_vs_contiguous(fig, data: dict) -> None:
    ax = fig.subplots()
    rows = sorted(rows_with(data, "decode_tokens", "paged_decode_tok_s_mean"), key=lambda r: r["decode_tokens"])
    _bars(ax, [f"{r['decode_tokens']} tokens" for r in rows],
          {"paged KV cache": [mean_std(r, "paged_decode_tok_s") for r in rows],
           "contiguous KV cache": [mean_std(r, "contiguous_decode_tok_s") for r in rows]})
    ax.set_xlabel("decode length (one request)")
    ax.set_ylabel("decode tokens/s")


def _draw_prefix_cache(fig, data: dict) -> None:
    warm = rows_of(data, table="warm-prefix")
    cold = rows_of(data, table="cold-burst")
    axes = fig.subplots(1, 2 if warm and cold else 1, squeeze=False)[0]
    if warm:
        ax = axes[0]
        _bars(ax, [f"{r['overlap_pct']}%" for r in warm],
              {"cache off (cold)": [(to_ms(r.get("ttft_off_s")), to_ms(r.get("ttft_off_s_std"))) for r in warm],
               "cache on (warm)": [(to_ms(r.get("ttft_on_s")), to_ms(r.get("ttft_on_s_std"))) for r in warm]})
        ax.set_title("warm prefix: TTFT by shared-prefix overlap", fontsize=9)
        ax.set_xlabel("prompt overlap with an earlier request")
        ax.set_ylabel("TTFT (ms)")
    if cold:
        ax = axes[-1]
        _bars(ax, [textwrap.fill(str(r["strategy"]), 14) for r in cold],
              {"mean TTFT": [mean_std(r, "mean_ttft_s", 1000.0) for r in cold]})
        ax.set_title(f"cold burst of {cold[0].get('requests', '?')} identical requests", fontsize=9)
        ax.set_ylabel("mean TTFT (ms)")


_RELEASES = {"independent": "independent (no sharing)", "at_completion": "release at leader completion",
             "after_prefill": "release after leader prefill"}


def _draw_single_flight(fig, data: dict) -> None:
    ax = fig.subplots()
    rows = rows_of(data, table="single-flight")
    sizes = ordered(r["requests"] for r in rows)
    releases = ordered(r["release"] for r in rows)

    def cell(n, release):
        match = [r for r in rows if r["requests"] == n and r["release"] == release]
        return mean_std(match[0], "mean_ttft_s", 1000.0) if match else (None, None)

    _bars(ax, [f"{n} requests" for n in sizes],
          {_RELEASES.get(rel, rel): [cell(n, rel) for n in sizes] for rel in releases})
    ax.set_xlabel("identical requests submitted together")
    ax.set_ylabel("mean TTFT (ms)")


def _draw_speculative_greedy(fig, data: dict) -> None:
    ax = fig.subplots()
    rows = rows_of(data, table="greedy")
    prompts = ordered(r["prompt"] for r in rows)
    cases = ordered(r["case"] for r in rows)

    def cell(prompt, case):
        match = [r for r in rows if r["prompt"] == prompt and r["case"] == case]
        return match[0] if match else {}

    _bars(ax, [f"{p} prompt" for p in prompts],
          {case: [(to_number(cell(p, case).get("tok_s_mean")), to_number(cell(p, case).get("tok_s_std")))
                  for p in prompts] for case in cases},
          annotate={case: [_speedup(cell(p, case)) for p in prompts] for case in cases})
    ax.set_ylabel("end-to-end tokens/s")
    ax.set_title("over each bar: end-to-end speedup vs target-only", fontsize=9)
    ax.legend(fontsize=7, ncol=2)


def _speedup(row: dict) -> str | None:
    v = to_number(row.get("speedup_e2e"))
    return None if v is None else f"{v:.2f}×"


def _draw_speculative_tv(fig, data: dict) -> None:
    rows = rows_of(data, table="sampling")
    prompts = ordered(r["prompt"] for r in rows)
    axes = fig.subplots(1, len(prompts), squeeze=False)[0]
    for ax, prompt in zip(axes, prompts):
        mine = [r for r in rows if r["prompt"] == prompt]
        spec = [r for r in mine if r.get("policy") not in (None, "draft-only")]
        _lines(ax, {policy: [(r["tv_budget"], to_number(r.get("tok_s_mean")), to_number(r.get("tok_s_std")))
                             for r in spec if r["policy"] == policy]
                    for policy in ordered(r["policy"] for r in spec)})
        for case, style, label in (("target-only", "--", "target only: break-even"),
                                   ("draft-only", ":", "draft only: upper bound")):
            for r in mine:
                if r["case"] == case and to_number(r.get("tok_s_mean")) is not None:
                    ax.axhline(r["tok_s_mean"], linestyle=style, color="0.3", linewidth=1, label=label)
        ax.legend(fontsize=7)
        ax.set_title(f"{prompt} prompt, sampling", fontsize=9)
        ax.set_xlabel("TV budget (0 = exact target distribution)")
        ax.set_ylabel("end-to-end tokens/s")
        ax.set_ylim(bottom=0)


def _draw_routing(fig, data: dict) -> None:
    ax = fig.subplots()
    rows = rows_with(data, "burst", "completion_s_mean")
    bursts = sorted(ordered(r["burst"] for r in rows))
    policies = ordered(r["policy"] for r in rows)

    def cell(burst, policy):
        match = [r for r in rows if r["burst"] == burst and r["policy"] == policy]
        return mean_std(match[0], "completion_s") if match else (None, None)

    _bars(ax, [f"burst of {b}" for b in bursts], {p: [cell(b, p) for b in bursts] for p in policies})
    ax.set_xlabel("requests submitted in one burst")
    ax.set_ylabel("burst completion time (s, lower is better)")


def _engine_label(row: dict, vary: set[str]) -> str:
    extra = [str(row[k]) for k in ("device", "dtype") if k in vary and row.get(k) is not None]
    return "\n".join([str(row.get("engine", "?")), " ".join(extra)]) if extra else str(row.get("engine", "?"))


def _draw_engines(fig, data: dict) -> str | None:
    """Prefill and decode tok/s per engine (peers, decode): two panels, their scales differ ~50x."""
    rows = rows_with(data, "prefill_tok_s_mean", "decode_tok_s_mean")
    vary = {k for k in ("device", "dtype") if len({str(r.get(k)) for r in rows}) > 1}
    labels = [_engine_label(r, vary) for r in rows]
    axes = fig.subplots(1, 2)
    for ax, key, what in ((axes[0], "prefill_tok_s", "prefill"), (axes[1], "decode_tok_s", "decode")):
        _bars(ax, labels, {what: [mean_std(r, key) for r in rows]})
        ax.set_ylabel(f"{what} tokens/s")
        ax.set_title(what, fontsize=9)
    missing = [f"{r.get('engine')}: {str(r.get('status')).split('(')[0].strip()}" for r in data.get("rows") or []
               if r.get("status") not in (None, "ok")]
    return "not measured: " + "; ".join(missing) if missing else None


def _draw_peers_gpu(fig, data: dict) -> None:
    ax = fig.subplots()
    rows = rows_with(data, "batch", "output_tok_s_mean")
    _lines(ax, {engine: [(r["batch"], *mean_std(r, "output_tok_s")) for r in rows if r.get("engine") == engine]
                for engine in ordered(r.get("engine") for r in rows)})
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (requests generated together)")
    ax.set_ylabel("output tokens/s")


def _draw_offline(fig, data: dict) -> None:
    ax = fig.subplots()
    runs = rows_with(data, "output_tok_s", "total_tok_s")
    summary = next((r for r in data.get("rows") or [] if to_number(r.get("output_tok_s_mean")) is not None), None)
    keys = (("output_tok_s", "output tokens/s"), ("total_tok_s", "prompt + output tokens/s"))
    if summary:
        _bars(ax, [label for _, label in keys], {"mean ± std over runs": [mean_std(summary, k) for k, _ in keys]})
    for i, (key, _) in enumerate(keys):
        ax.plot([i] * len(runs), [r[key] for r in runs], "k.", markersize=6,
                label="single runs" if i == 0 else None)
    ax.set_xticks(range(len(keys)), [label for _, label in keys])
    ax.set_ylabel("tokens/s")
    ax.legend(fontsize=8)
    settings = (data.get("provenance") or {}).get("settings") or {}
    ax.set_title(f"{settings.get('num_seqs', '?')} requests, input {settings.get('input_len_range', '?')}, "
                 f"output {settings.get('output_len_range', '?')} tokens", fontsize=9)


def _draw_activation_dtype(fig, data: dict) -> str | None:
    rows = rows_with(data, "decode_tok_s_mean", "peak_mib")
    dtypes = [str(r.get("dtype")) for r in rows]
    axes = fig.subplots(1, 3)
    panels = ((axes[0], "ttft_ms", "TTFT (ms)", "time to first token"),
              (axes[1], "decode_tok_s", "decode tokens/s", "batch-1 decode"))
    for ax, key, unit, title in panels:
        _bars(ax, dtypes, {"mean ± std": [mean_std(r, key) for r in rows]})
        ax.set_ylabel(unit)
        ax.set_title(title, fontsize=9)
        if ax.get_legend() is not None:  # one series: the panel title says what it is
            ax.get_legend().remove()
    # Peak memory split into what the load left resident and what generation added on top.
    resident = [to_number(r.get("after_load_mib")) or 0.0 for r in rows]
    peak = [to_number(r.get("peak_mib")) or 0.0 for r in rows]
    ax = axes[2]
    ax.bar(range(len(rows)), resident, 0.6, label="after load")
    ax.bar(range(len(rows)), [max(0.0, p - q) for p, q in zip(peak, resident)], 0.6, bottom=resident,
           label="added while generating")
    ax.set_xticks(range(len(rows)), dtypes, fontsize=8)
    ax.set_ylabel("peak memory (MiB)")
    ax.set_title("peak memory", fontsize=9)
    ax.legend(fontsize=7)
    method = next((r.get("memory_method") for r in rows if r.get("memory_method")), None)
    return f"memory: {method}" if method else None


def _on_h200(figure: "Figure") -> "Figure":
    """The same figure drawn from the H200 result files (named h200-<benchmark>-...)."""
    return Figure(f"h200-{figure.name}", f"h200-{figure.prefix}", f"{figure.title} (H200)",
                  f"{figure.shows}, on the H200", figure.wants, figure.draw)


def _serve_targets(data: dict) -> list[dict]:
    """A serve-compare file lists its servers; a per-server file is one."""
    if data.get("targets"):
        return [t for t in data["targets"] if isinstance(t.get("summary"), dict)]
    return [data] if isinstance(data.get("summary"), dict) else []


def _draw_serve(fig, data: dict) -> None:
    targets = _serve_targets(data)
    labels = [str(t.get("label", "?")) for t in targets]
    axes = fig.subplots(1, 2)
    for ax, key, what in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "tpot_ms", "TPOT")):
        stats = [t["summary"].get(key) or {} for t in targets]
        _bars(ax, labels, {"p50": [(to_number(s.get("median")), None) for s in stats],
                           "p99": [(to_number(s.get("p99")), None) for s in stats]})
        ax.set_ylabel(f"{what} (ms)")
        ax.set_title(what, fontsize=9)


FIGURES: tuple[Figure, ...] = (
    Figure(
        "gemv-threshold",
        "gemv-threshold-",
        "GEMV threshold: aggregate output tok/s by concurrency (CPU)",
        "unbatched vs batched GEMM vs batched row-wise GEMV, tok/s by number of concurrent requests",
        lambda d: bool(rows_with(d, "concurrency", "gemv_tok_s_mean")),
        _draw_gemv_threshold,
    ),
    Figure(
        "h200-gemv-threshold",
        "h200-gemv-threshold-",
        "GEMV threshold: aggregate output tok/s by concurrency (H200)",
        "the same sweep on the H200",
        lambda d: bool(rows_with(d, "concurrency", "gemv_tok_s_mean")),
        _draw_gemv_threshold,
    ),
    Figure(
        "continuous-batching",
        "continuous-batching-",
        "Continuous batching: batched vs sequential",
        "aggregate output tok/s of N requests batched vs one after another",
        lambda d: bool(rows_with(d, "concurrency", "batched_tok_s_mean")),
        _draw_continuous_batching,
    ),
    Figure(
        "paged-vs-contiguous",
        "paged-vs-contiguous-",
        "Paged vs contiguous KV cache: decode tok/s",
        "single-request decode tok/s with a paged and a contiguous KV cache, by decode length",
        lambda d: bool(rows_with(d, "decode_tokens", "paged_decode_tok_s_mean")),
        _draw_paged_vs_contiguous,
    ),
    Figure(
        "prefix-cache",
        "prefix-cache-",
        "Prefix cache: TTFT cold vs warm",
        "TTFT with the prefix cache off (cold) and on (warm) by prompt overlap; the cold burst's strategies",
        lambda d: bool(rows_of(d, table="warm-prefix") or rows_of(d, table="cold-burst")),
        _draw_prefix_cache,
    ),
    Figure(
        "prefix-cache-single-flight",
        "prefix-cache-",
        "Prefix cache single flight: mean TTFT by release policy",
        "mean TTFT of identical requests: independent vs followers released at leader completion or after prefill",
        lambda d: bool(rows_of(d, table="single-flight")),
        _draw_single_flight,
    ),
    Figure(
        "speculative-greedy",
        "speculative-",
        "Speculative decoding (greedy): tok/s per draft policy",
        "end-to-end tok/s per draft policy and prompt, with the speedup over target-only",
        lambda d: bool(rows_of(d, table="greedy")),
        _draw_speculative_greedy,
    ),
    Figure(
        "speculative-tv-budget",
        "speculative-",
        "Mentored decoding: tok/s by TV budget (break-even curve)",
        "end-to-end tok/s by TV budget per draft policy against target-only (break-even) and draft-only",
        lambda d: bool(rows_of(d, table="sampling")),
        _draw_speculative_tv,
    ),
    Figure(
        "routing",
        "routing-",
        "Routing: burst completion time per policy (CPU workers)",
        "time to finish a burst of requests per routing policy and burst size",
        lambda d: bool(rows_with(d, "burst", "completion_s_mean")),
        _draw_routing,
    ),
    Figure(
        "h200-routing",
        "h200-routing-",
        "Routing: burst completion time per policy (H200 + CPU)",
        "the same with an H200 and a CPU worker",
        lambda d: bool(rows_with(d, "burst", "completion_s_mean")),
        _draw_routing,
    ),
    Figure(
        "peers",
        "peers-",
        "Peers on the same GGUF file: prefill and decode tok/s",
        "prefill and decode tok/s per engine (minivllm, transformers, llama.cpp when installed)",
        lambda d: bool(rows_with(d, "prefill_tok_s_mean", "decode_tok_s_mean")),
        _draw_engines,
    ),
    Figure(
        "peers-gpu",
        "peers-gpu-",
        "Peers on a GPU: batched generation tok/s",
        "output tok/s by batch size, minivllm vs transformers' generate",
        lambda d: bool(rows_with(d, "batch", "output_tok_s_mean")),
        _draw_peers_gpu,
    ),
    Figure(
        "decode",
        "decode-",
        "Batch-1 prefill and decode tok/s per engine",
        "`bench decode`: prefill and decode tok/s per engine, device and dtype",
        lambda d: bool(rows_with(d, "prefill_tok_s_mean", "decode_tok_s_mean")),
        _draw_engines,
    ),
    Figure(
        "offline",
        "offline-",
        "Offline throughput (random prompts, all submitted at once)",
        "output and total tok/s, mean ± std over fresh engines, and every run",
        lambda d: bool(rows_with(d, "output_tok_s", "total_tok_s")),
        _draw_offline,
    ),
    Figure(
        "serve",
        "serve-",
        "Online serving load: TTFT and TPOT per server",
        "TTFT and TPOT p50/p99 per server under the same seeded load",
        lambda d: bool(_serve_targets(d)),
        _draw_serve,
    ),
    Figure(
        "activation-dtype",
        "activation-dtype-",
        "Activation dtype: TTFT, decode tok/s and peak memory",
        "f32 / f16 / bf16, a fresh process each: TTFT, decode tok/s, peak memory (resident after load + generation)",
        lambda d: bool(rows_with(d, "decode_tok_s_mean", "peak_mib")),
        _draw_activation_dtype,
    ),
)
# Figures whose GPU rows come from H200 result files kept beside the CPU ones.
FIGURES += tuple(_on_h200(f) for f in FIGURES
                 if f.name in ("paged-vs-contiguous", "peers-gpu", "offline", "activation-dtype", "decode"))


# ------------------------------------------------------------------ rendering

