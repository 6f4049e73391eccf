"""One split request on a timeline (issue 43): prefill on worker A, the K/V handed to
worker B, decode on B, drawn as bars in one lane per worker, with both workers' queues
and KV pages over the same time axis below.

Inputs are plain records, so the figure is tested against hand-made ones:
- `record`: the split record (`cluster.snapshot()["splits"]["recent"][-1]`, which keeps
  `started_at`, the wall-clock time A began the export; the stream's `metrics["split"]`
  drops it): kv_bytes, write_ms, export_ms, read_ms, import_ms, handoff_ms, the workers
  and tokens_on_prefill_worker;
- `submitted`, `token_times`, `finished`: the client's wall-clock (`time.time()`) events;
- `samples`: `minivllm.serving.snapshot_sampler` rows (t, worker, running, waiting,
  held_pages, cached_pages).

Where each bar comes from (seconds after `submitted`; every worker stamps `time.time()`,
one clock on one machine):
    A  prefill + first token   submitted .. started_at
    A  gather the K/V          started_at .. export end - write_ms: the export's time but the
                               write, drawn before it, since most of it is gathering the
                               pages' K/V (from a GPU: their copy to host memory); the small
                               bookkeeping after the write (the message, the release) is in it
    A  write K/V to segment    .. export end = started_at + export_ms
    B  read into B's pool      import start .. + read_ms, where import start =
                               started_at + handoff_ms - import_ms (the handoff ends when B
                               has imported)
    B  adopt + admit           .. + import_ms (pages into B's prefix cache, the request
                               into B's scheduler)
    B  decode                  handoff end .. finished
The gap between A's export and B's import is the controller relaying the message.
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

COLOURS = {"prefill": "#4285f4", "gather": "#f4a6a0", "write": "#ea4335", "relay": "#cccccc", "read": "#fbbc05",
           "import": "#fde293", "decode": "#34a853"}
SERIES_COLOURS = ["#4285f4", "#9c27b0"]  # worker A, worker B in the queue and page rows


def split_phases(record: dict, submitted: float, finished: float) -> list[dict]:
    """The bars: [{"lane", "phase", "start", "end", "label"}], seconds after `submitted`."""
    a, b = record["prefill_worker"], record["decode_worker"]
    exported = record["started_at"] - submitted
    export_end = exported + max(record["export_ms"], record["write_ms"]) / 1e3
    write_start = export_end - record["write_ms"] / 1e3
    handoff_end = exported + record["handoff_ms"] / 1e3
    import_start = max(export_end, handoff_end - record["import_ms"] / 1e3)
    read_end = min(handoff_end, import_start + record["read_ms"] / 1e3)
    mb = record["kv_bytes"] / 1e6
    phases = [
        (a, "prefill", 0.0, exported, f"prefill {record.get('kv_tokens', '?')} tokens + first token"),
        (a, "gather", exported, write_start, f"gather the pages' K/V: {(write_start - exported) * 1e3:.0f} ms"),
        (a, "write", write_start, export_end, f"write {mb:.1f} MB to the segment: {record['write_ms']:.0f} ms"),
        (b, "relay", export_end, import_start, f"controller relays: {(import_start - export_end) * 1e3:.0f} ms"),
        (b, "read", import_start, read_end, f"read {mb:.1f} MB into {b}'s pool: {record['read_ms']:.0f} ms"),
        (b, "import", read_end, handoff_end, f"adopt pages + admit: {(handoff_end - read_end) * 1e3:.0f} ms"),
        (b, "decode", handoff_end, finished - submitted, f"decode on {b}"),
    ]
    return [{"lane": lane, "phase": phase, "start": s, "end": e, "label": label}
            for lane, phase, s, e, label in phases if e > s]


def handoff_label(record: dict) -> str:
    """The handoff in one line: bytes, its milliseconds, and the copy rate."""
    return (f"handoff: {record['kv_bytes'] / 1e6:.1f} MB of K/V for {record.get('kv_tokens', '?')} tokens in "
            f"{record['handoff_ms']:.0f} ms (write {record['write_ms']:.0f} ms + read {record['read_ms']:.0f} ms "
            f"= {record['copy_mb_per_s']:.0f} MB/s)")


def with_gaps(rows: list[dict], gap_s: float) -> list[dict | None]:
    """`rows` (one worker's samples, in time order) with None between two that are more than
    `gap_s` apart: the worker answered nothing then (it was inside one long step), and the
    line must break there rather than hold the older value across."""
    out: list[dict | None] = []
    for row in rows:
        if out and row["t"] - out[-1]["t"] > gap_s:
            out.append(None)
        out.append(row)
    return out


def timeline_figure(record: dict, submitted: float, token_times: list[float], finished: float,
                    samples: list[dict], *, margin_s: float = 0.2, gap_s: float = 0.5) -> go.Figure:
    """Lanes (A above B), then queue lengths, then KV pages; one shared time axis. A worker's
    sampled lines break where it answered nothing for more than `gap_s` (`with_gaps`)."""
    a, b = record["prefill_worker"], record["decode_worker"]
    lanes = [a, b]
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.06, row_heights=[0.34, 0.33, 0.33],
                        subplot_titles=("the request on each worker", "queues (requests)", "KV pages"))
    for p in split_phases(record, submitted, finished):
        fig.add_trace(go.Bar(
            y=[p["lane"]], x=[p["end"] - p["start"]], base=[p["start"]], orientation="h", name=p["phase"],
            marker_color=COLOURS[p["phase"]], legendgroup="phases", legendgrouptitle_text="phases",
            hovertemplate=f"{p['label']}<br>%{{base:.3f}} s .. {p['end']:.3f} s<extra></extra>"), row=1, col=1)
    on_a = int(record.get("tokens_on_prefill_worker", 1))
    times = [t - submitted for t in token_times]
    for lane, ts, first in ((a, times[:on_a], 1), (b, times[on_a:], on_a + 1)):
        if ts:
            fig.add_trace(go.Scatter(
                x=ts, y=[lane] * len(ts), mode="markers", name=f"tokens on {lane}", legendgroup="tokens",
                marker={"symbol": "line-ns-open", "size": 14, "color": "#222"},
                customdata=list(range(first, first + len(ts))),
                hovertemplate="token %{customdata} at %{x:.3f} s<extra></extra>"), row=1, col=1)
    end = finished - submitted
    window = [s for s in samples if -margin_s <= s["t"] - submitted <= end + margin_s and s["worker"] in lanes]
    for i, lane in enumerate(lanes):
        rows = with_gaps(sorted((s for s in window if s["worker"] == lane), key=lambda s: s["t"]), gap_s)
        # a break sits halfway between the samples around it, with no value
        x = [(rows[j - 1]["t"] + rows[j + 1]["t"]) / 2 - submitted if s is None else s["t"] - submitted
             for j, s in enumerate(rows)]
        colour = SERIES_COLOURS[i]
        for key, row, dash in (("running", 2, "solid"), ("waiting", 2, "dot"),
                               ("held_pages", 3, "solid"), ("cached_pages", 3, "dot")):
            name = f"{lane} {key.replace('_pages', ' pages')}"
            fig.add_trace(go.Scatter(x=x, y=[None if s is None else s[key] for s in rows], mode="lines+markers",
                                     name=name, connectgaps=False,
                                     line={"shape": "hv", "color": colour, "dash": dash, "width": 1.5},
                                     marker={"size": 3}, legendgroup=lane, legendgrouptitle_text=lane,
                                     hovertemplate=f"{name}: %{{y}} at %{{x:.3f}} s<extra></extra>"), row=row, col=1)
    start = record["started_at"] - submitted  # the handoff, shaded across all three rows
    fig.add_vrect(x0=start, x1=start + record["handoff_ms"] / 1e3, fillcolor=COLOURS["write"], opacity=0.15,
                  line_width=0)
    # between the two lanes, ending where the handoff starts: clear of the bars' ends and the title
    fig.add_annotation(x=start, xref="x", yref="y domain", y=0.5, yanchor="middle", xanchor="right",
                       showarrow=False, font={"size": 10}, bgcolor="rgba(255,255,255,0.85)",
                       text=f"handoff {record['kv_bytes'] / 1e6:.1f} MB, {record['handoff_ms']:.0f} ms")
    fig.update_yaxes(categoryorder="array", categoryarray=lanes[::-1], row=1, col=1)
    fig.update_yaxes(title_text="requests", rangemode="tozero", row=2, col=1)
    fig.update_yaxes(title_text="pages", rangemode="tozero", row=3, col=1)
    fig.update_xaxes(title_text="seconds after submit", range=[-margin_s, end + margin_s], row=3, col=1)
    fig.update_layout(barmode="overlay", height=620, template="plotly_white", margin={"l": 70, "r": 10, "t": 60},
                      title={"text": handoff_label(record), "font": {"size": 13}}, legend={"groupclick": "toggleitem"})
    return fig
