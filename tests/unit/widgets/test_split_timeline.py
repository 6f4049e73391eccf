"""The split request's timeline (widgets/split_timeline.py) against a hand-made split
record: every bar's start and width worked out by hand from write_ms, export_ms,
handoff_ms, import_ms and read_ms (the module docstring's rules), the tokens on the lane
of the worker that made them, the sampled queues and pages as given, and the figure as
plotly.js receives it (tests/plotly_html.py: strict JSON, no NaN or infinity)."""

from __future__ import annotations

import math

import plotly_html
import pytest

from minivllm_widgets.split_timeline import handoff_label, split_phases, timeline_figure
from minivllm_widgets.static_charts import figure_html

T0 = 1_000_000.0  # the client's submit time (wall clock)
RECORD = {"request_id": "r1", "prefill_worker": "cpu", "decode_worker": "cpu#2", "handed_off": True,
          "tokens_on_prefill_worker": 1, "kv_bytes": 55_296_000, "kv_tokens": 1200,
          "started_at": T0 + 2.0, "write_ms": 150.0, "export_ms": 300.0, "read_ms": 100.0, "import_ms": 120.0,
          "handoff_ms": 500.0, "copy_mb_per_s": 221.184}
FINISHED = T0 + 4.0
TOKENS = [T0 + 2.0, T0 + 2.6, T0 + 2.7]
COLUMNS = ("t", "worker", "running", "waiting", "held_pages", "cached_pages", "total_pages")
SAMPLES = [dict(zip(COLUMNS, row)) for row in [
    (T0 - 5.0, "cpu", 9, 9, 9, 9, 768),  # before the window: left out
    (T0 + 0.1, "cpu", 1, 0, 75, 0, 768),
    (T0 + 0.1, "cpu#2", 0, 0, 0, 0, 768),
    (T0 + 2.4, "cpu", 0, 0, 0, 75, 768),
    (T0 + 2.6, "cpu#2", 1, 0, 76, 0, 768),
    (T0 + 9.0, "cpu#2", 7, 7, 7, 7, 768),  # after the window: left out
]]


def test_phases_by_hand():
    phases = {p["phase"]: p for p in split_phases(RECORD, T0, FINISHED)}
    # export starts 2.0 s after submit and ends 300 ms later; the write is its last 150 ms;
    # the handoff ends at 2.0 + 0.5; B's import began import_ms (120 ms) before that, at 2.38;
    # its read took the first 100 ms of it.
    expected = {"prefill": ("cpu", 0.0, 2.0), "gather": ("cpu", 2.0, 2.15), "write": ("cpu", 2.15, 2.3),
                "relay": ("cpu#2", 2.3, 2.38), "read": ("cpu#2", 2.38, 2.48), "import": ("cpu#2", 2.48, 2.5),
                "decode": ("cpu#2", 2.5, 4.0)}
    assert set(phases) == set(expected)
    for name, (lane, start, end) in expected.items():
        assert phases[name]["lane"] == lane, name
        assert phases[name]["start"] == pytest.approx(start), name
        assert phases[name]["end"] == pytest.approx(end), name
    assert "55.3 MB" in phases["write"]["label"] and "150 ms" in phases["write"]["label"]
    assert "55.3 MB" in phases["read"]["label"] and "100 ms" in phases["read"]["label"]
    assert "80 ms" in phases["relay"]["label"] and "150 ms" in phases["gather"]["label"]


def test_a_phase_with_no_time_is_left_out():
    # The export took exactly the write; B's import started the moment A's export ended.
    record = dict(RECORD, export_ms=150.0, handoff_ms=270.0, import_ms=120.0)
    names = [p["phase"] for p in split_phases(record, T0, FINISHED)]
    assert "gather" not in names and "relay" not in names
    assert names == ["prefill", "write", "read", "import", "decode"]


def _figure_as_plotlyjs_gets_it(fig) -> dict:
    (fig_json,) = plotly_html.figures(figure_html(fig))  # strict JSON: a NaN or infinity fails here
    return fig_json


def test_figure_bars_tokens_and_samples():
    fig = _figure_as_plotlyjs_gets_it(timeline_figure(RECORD, T0, TOKENS, FINISHED, SAMPLES, gap_s=10.0))
    bars = {t["name"]: t for t in fig["data"] if t["type"] == "bar"}
    assert bars["write"]["y"] == ["cpu"] and bars["write"]["base"] == pytest.approx([2.15])
    assert bars["write"]["x"] == pytest.approx([0.15])
    assert bars["read"]["y"] == ["cpu#2"] and bars["read"]["base"] == pytest.approx([2.38])
    assert bars["read"]["x"] == pytest.approx([0.1])
    assert bars["decode"]["base"] == pytest.approx([2.5]) and bars["decode"]["x"] == pytest.approx([1.5])
    scatters = {t["name"]: t for t in fig["data"] if t["type"] == "scatter"}
    assert scatters["tokens on cpu"]["x"] == pytest.approx([0.0 + 2.0])
    assert scatters["tokens on cpu#2"]["x"] == pytest.approx([2.6, 2.7])
    assert scatters["tokens on cpu#2"]["customdata"] == [2, 3]  # token numbers continue across workers
    # samples outside [-0.2 s, end + 0.2 s] are left out; the rest as sampled
    assert scatters["cpu running"]["x"] == pytest.approx([0.1, 2.4]) and scatters["cpu running"]["y"] == [1, 0]
    assert scatters["cpu held pages"]["y"] == [75, 0] and scatters["cpu cached pages"]["y"] == [0, 75]
    assert scatters["cpu#2 held pages"]["x"] == pytest.approx([0.1, 2.6])
    assert scatters["cpu#2 held pages"]["y"] == [0, 76]
    assert scatters["cpu running"]["yaxis"] == "y2" and scatters["cpu held pages"]["yaxis"] == "y3"
    # the handoff, shaded across the rows and named in the title
    bands = [s for s in fig["layout"]["shapes"] if s["type"] == "rect"]
    assert len(bands) == 3 and all((b["x0"], b["x1"]) == pytest.approx((2.0, 2.5)) for b in bands)
    (note,) = [a for a in fig["layout"]["annotations"] if a["text"].startswith("handoff")]
    assert note["x"] == pytest.approx(2.0) and note["text"] == "handoff 55.3 MB, 500 ms"
    assert fig["layout"]["title"]["text"] == handoff_label(RECORD)
    label = handoff_label(RECORD)
    assert "55.3 MB" in label and "500 ms" in label and "221 MB/s" in label
    for t in fig["data"]:
        for key in ("x", "base"):
            assert all(math.isfinite(v) for v in t.get(key) or [] if not isinstance(v, str)), (t["name"], key)


def test_a_worker_silent_inside_a_long_step_breaks_its_lines():
    # A answered at 0.1 s, then nothing until 2.4 s (inside its prefill step): no line may
    # hold 0.1 s's value across that stretch; B answered every 0.3 s and keeps its line.
    samples = SAMPLES + [dict(SAMPLES[2], t=T0 + 0.4), dict(SAMPLES[2], t=T0 + 0.7)]
    fig = _figure_as_plotlyjs_gets_it(timeline_figure(RECORD, T0, TOKENS, FINISHED, samples, gap_s=0.5))
    scatters = {t["name"]: t for t in fig["data"] if t["type"] == "scatter"}
    assert scatters["cpu running"]["y"] == [1, None, 0]
    assert scatters["cpu running"]["x"] == pytest.approx([0.1, 1.25, 2.4])  # the break halfway
    assert scatters["cpu held pages"]["y"] == [75, None, 0]
    # B: 0.1, 0.4, 0.7 then 2.6 (1.9 s later: a break), nothing else
    assert scatters["cpu#2 held pages"]["y"] == [0, 0, 0, None, 76]
