"""The break-even chart (widgets/break_even.py) against hand arithmetic: the article's
curve 86 ms / n (0.672 ms/token at 128 tokens, 0.168 at 512, the article's 0.67 and 0.17),
each measured prompt's curve from its median transfer, the advantage lines as the mean
per backlog, the verdict markers where the rows put them; read back as plotly.js gets it."""

from __future__ import annotations

import plotly_html
import pytest

from minivllm_widgets.break_even import (
    ARTICLE_KV_BYTES,
    ARTICLE_LINK_BYTES_PER_S,
    ARTICLE_TRANSFER_MS,
    break_even_figure,
)
from minivllm_widgets.static_charts import figure_html


def _row(prompt, backlog, transfer_ms, advantage, measured, n=32, kv_bytes=None):
    return {"prompt_tokens": prompt, "max_tokens": n, "backlog": backlog, "transfer_ms": transfer_ms,
            "kv_bytes": kv_bytes or prompt * 46_080, "advantage_ms_per_token": advantage,
            "break_even_ms_per_token": transfer_ms / n, "formula_says_split_pays": advantage > transfer_ms / n,
            "measured_split_pays": measured}


LIVE = [_row(256, 0, 100.0, -0.5, False), _row(1024, 0, 400.0, 0.5, False),
        _row(256, 4, 120.0, 5.0, True), _row(1024, 4, 420.0, 7.0, True)]


def _traces(fig) -> dict:
    (fig_json,) = plotly_html.figures(figure_html(fig))  # strict JSON: no NaN or infinity reaches plotly.js
    return {t["name"]: t for t in fig_json["data"]}, fig_json["layout"]


def _named(traces: dict, prefix: str) -> dict:
    (name,) = [n for n in traces if n.startswith(prefix)]
    return traces[name]


def test_the_articles_numbers():
    # 2 GiB at 25 GB/s is 85.9 ms, which the article rounds to 86
    assert ARTICLE_KV_BYTES / ARTICLE_LINK_BYTES_PER_S * 1e3 == pytest.approx(85.9, abs=0.05)
    traces, layout = _traces(break_even_figure(LIVE, answers=[16, 128, 512, 1024]))
    article = traces[next(n for n in traces if n.startswith("article"))]
    assert article["x"] == [16, 128, 512, 1024]
    assert article["y"] == pytest.approx([86 / 16, 0.671875, 0.16796875, 86 / 1024])
    assert round(article["y"][1], 3) == 0.672 and round(article["y"][2], 2) == 0.17
    marks = traces["the article's two thresholds"]
    assert marks["x"] == [128, 512] and marks["text"] == ["0.67 ms/token at 128", "0.17 ms/token at 512"]
    assert layout["xaxis"]["type"] == "log"
    assert layout["xaxis"]["range"] == pytest.approx([1.2041 - 0.03, 3.0103 + 0.03], abs=1e-4)  # log10 16, 1024
    assert ARTICLE_TRANSFER_MS == 86.0


def test_measured_curves_lines_and_markers():
    traces, _ = _traces(break_even_figure(LIVE, answers=[16, 32, 1024]))
    # transfer per prompt length: the median of its cases, (100 + 120) / 2 and (400 + 420) / 2
    c256 = traces[next(n for n in traces if n.startswith("live: transfer / n, 256-token"))]
    assert c256["y"] == pytest.approx([110 / 16, 110 / 32, 110 / 1024])
    c1024 = traces[next(n for n in traces if n.startswith("live: transfer / n, 1024-token"))]
    assert c1024["y"][1] == pytest.approx(410 / 32)
    assert "(47.2 MB in 410 ms)" in next(n for n in traces if n.startswith("live: transfer / n, 1024-token"))
    # the advantage per backlog: the mean over its cases, drawn across the x range
    idle = traces["live: advantage A − B, backlog 0 on A: 0.00 ms/token"]
    busy = traces["live: advantage A − B, backlog 4 on A: 6.00 ms/token"]
    assert idle["y"] == pytest.approx([0.0, 0.0]) and busy["y"] == pytest.approx([6.0, 6.0])
    assert busy["x"] == [16, 1024]
    pays = _named(traces, "live: ● split faster than whole on A")
    slower = _named(traces, "live: ✕ split not faster than whole on A")
    assert pays["x"] == [32, 32] and pays["y"] == pytest.approx([5.0, 7.0])
    assert slower["y"] == pytest.approx([-0.5, 0.5])
    # the formula's verdict in the hover: 5.0 > 120 / 32 = 3.75 pays; 7.0 < 420 / 32 = 13.1 does not
    assert [c[2] for c in pays["customdata"]] == ["pays", "does not pay"]
    # each marker in its prompt's curve colour, labelled with its backlog
    assert pays["marker"]["color"] == [c256["line"]["color"], c1024["line"]["color"]]
    assert pays["text"] == ["b4", "b4"] and slower["text"] == ["b0", "b0"]

def test_committed_rows_drawn_beside_and_non_finite_left_out():
    bench = [_row(4096, 8, 90.0, 1.0, True, n=128), dict(_row(512, 0, 10.0, 0.0, False, n=128),
                                                        advantage_ms_per_token=float("nan"))]
    traces, _ = _traces(break_even_figure(LIVE, bench, bench_label="bench", answers=[16, 128]))
    curve = traces[next(n for n in traces if n.startswith("bench: transfer / n, 4096-token"))]
    assert curve["y"] == pytest.approx([90 / 16, 90 / 128]) and curve["line"]["dash"] == "dot"
    # the committed run's advantage lines dashed unlike the live ones of the same backlog
    live_dashes = {t["line"]["dash"] for n, t in traces.items() if n.startswith("live: advantage")}
    bench_dashes = {t["line"]["dash"] for n, t in traces.items() if n.startswith("bench: advantage")}
    assert bench_dashes and not live_dashes & bench_dashes
    assert _named(traces, "bench: ● split faster")["x"] == [128]
    assert not any(n.startswith("bench: ✕") for n in traces)  # its one row had a NaN advantage
    assert "bench: advantage A − B, backlog 0 on A" not in " ".join(traces)


def test_transfer_is_the_median_and_advantage_the_mean():
    from minivllm_widgets.break_even import advantage_by_backlog, transfer_by_prompt

    rows = [_row(256, 0, 100.0, 1.0, False), _row(256, 4, 120.0, 2.0, False), _row(256, 8, 400.0, 9.0, True)]
    assert transfer_by_prompt(rows) == {256: {"transfer_ms": 120.0, "kv_bytes": 256 * 46_080}}
    rows.append(_row(1024, 8, 500.0, 3.0, True))
    assert advantage_by_backlog(rows) == {0: 1.0, 4: 2.0, 8: 6.0}
