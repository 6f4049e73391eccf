"""The notebook layer without a browser: view models from real engine snapshots, the PNG
page grid decoded pixel by pixel, and the publisher's message budget.

Messages are counted at `Widget._send`, the one place ipywidgets hands a message to the
comm, so the bound holds for whatever the panels do internally.
"""

from __future__ import annotations

import struct
import time
import zlib
from pathlib import Path

import numpy as np
import plotly_html
import pytest
from conftest import REPO_ROOT

from minivllm.engine.llm import LLM
from minivllm.sampling.sampling_params import SamplingParams

W = pytest.importorskip("ipywidgets")

# The widgets package imports ipywidgets, so it comes after the skip.
from minivllm_widgets import Publisher, Workbench  # noqa: E402
from minivllm_widgets.page_grid import (  # noqa: E402
    COLOURS,
    counts_from_codes,
    grid_layout,
    grid_shape,
    page_codes,
    render_page_grid,
)
from minivllm_widgets.panel_state import ThroughputTracker, kv_view, queues_view, router_view  # noqa: E402
from minivllm_widgets.panels import default_panels  # noqa: E402


def decode_png(data: bytes) -> np.ndarray:
    """An independent reader for the 8-bit RGB, filter-0 PNGs the grid writes."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, b""
    width = height = None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        tag, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(tag + body) & 0xFFFFFFFF, tag
        if tag == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", body[:10])
            assert (depth, colour) == (8, 2)
        elif tag == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    rows = [raw[y * (3 * width + 1):(y + 1) * (3 * width + 1)] for y in range(height)]
    assert all(r[0] == 0 for r in rows)
    return np.frombuffer(b"".join(r[1:] for r in rows), dtype=np.uint8).reshape(height, width, 3)


def test_page_grid_pixels_follow_page_states():
    # the pool's states as the snapshot carries them; the prefix index holds one reference
    states = ["free", "owned", "cached-idle", "cached-in-use", "shared", "shared"] + ["free"] * 20
    refs = [0, 1, 1, 2, 3, 6] + [0] * 20
    assert counts_from_codes(page_codes(states, refs)) == {
        "free": 21, "owned": 1, "cached-idle": 1, "cached-in-use": 1, "shared": 2}
    img = decode_png(render_page_grid(states, refs, cell=4, columns=10))
    rows, cols = grid_shape(len(states), 10)
    assert img.shape == (rows * 5 + 1, cols * 5 + 1, 3)

    def centre(i):
        r, c = divmod(i, cols)
        return tuple(int(v) for v in img[r * 5 + 3, c * 5 + 3])

    assert centre(0) == COLOURS["free"] and centre(1) == COLOURS["owned"] and centre(2) == COLOURS["cached-idle"]
    assert centre(3) == COLOURS["cached-in-use"]  # cached, one request: nothing shared
    assert centre(4) == COLOURS["shared"]  # two requests: the base colour
    assert sum(centre(5)) < sum(centre(4))  # five requests: darker
    assert tuple(int(v) for v in img[0, 0]) == (255, 255, 255)  # the gap between cells


def test_page_map_layout_is_fixed_width_and_at_most_300_px_tall():
    for n in (1, 16, 1456, 10_000, 100_000):
        pitch, columns, rows = grid_layout(n)
        assert columns * pitch <= 600 and rows * pitch <= 300 and columns * rows >= n, (n, pitch, columns, rows)
    assert grid_layout(1456)[0] >= 5 and grid_layout(10_000)[0] >= 3  # cells stay visible


def fake_cluster_snapshot(llm: LLM, t: float, decisions=()) -> dict:
    return {"schema": "minivllm.cluster.snapshot/1", "time": t,
            "router": {"policy": "cost", "counters": {}, "decisions": list(decisions)},
            "workers": [{"name": "cpu", "device": "cpu", "state": "ready", "snapshot": llm.snapshot()}]}


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(str(smollm2_path), progress=False, max_model_len=256)


def test_views_follow_a_real_engine_snapshot(llm):
    engine = llm.engine
    prompt = llm.tokenizer.encode("A fairly long prompt about caches " * 6)
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=8))
    waiting = queues_view(fake_cluster_snapshot(llm, 1.0))["cpu"]["requests"]
    assert [(r["id"], r["queue"], r["progress"]) for r in waiting] == [(rid, "waiting", 0.0)]
    engine.step()
    engine.step()
    snap = fake_cluster_snapshot(llm, 2.0)
    (row,) = queues_view(snap)["cpu"]["requests"]
    req = engine.request_state(rid)
    assert row["queue"] == "running" and row["phase"] == "decode"
    assert row["output_tokens"] == len(req.output_ids) and row["progress"] == round(len(req.output_ids) / 8, 2)
    kv = kv_view(snap)["cpu"]
    # one request: its published full pages are cached-in-use (one holder), the tail page
    # owned, and nothing is shared
    assert kv["counts"]["owned"] + kv["counts"]["cached-in-use"] == len(req.block_table)
    assert kv["counts"]["cached-in-use"] == len(req.prompt_ids) // engine.pool.page_size
    assert kv["counts"]["shared"] == 0
    assert sum(kv["counts"].values()) == kv["total"] == engine.pool.num_pages
    engine.release(rid)


def test_router_view_keeps_terms_and_choice():
    decision = {"request_id": "r1", "policy": "cost", "reason": "cost", "chosen": "b", "candidates": [
        {"worker": "a", "healthy": True, "active": 1, "queued": 0, "cached_tokens": 16, "prefill_s": 0.1,
         "decode_s": 2.0, "finish_s": 2.5, "score": 2.5},
        {"worker": "b", "healthy": True, "active": 0, "queued": 0, "cached_tokens": 0, "prefill_s": 0.01,
         "decode_s": 0.5, "finish_s": 0.51, "score": 0.51}]}
    view = router_view({"router": {"policy": "cost", "decisions": [decision] * 20}, "workers": []}, last=12)
    assert len(view["decisions"]) == 12
    a, b = view["decisions"][0]["candidates"]
    assert (a["prefill_s"], a["decode_s"], a["score"]) == (0.1, 2.0, 2.5) and b["score"] == 0.51


def test_throughput_tracker_differences_counters():
    tr = ThroughputTracker()
    def snap(t, d, p):
        return {
            "time": t,
            "workers": [{"name": "w", "snapshot": {"counters": {"decode_tokens": d, "prefill_tokens": p}}}],
        }
    assert tr.update(snap(0.0, 0, 0)) == {}
    assert tr.update(snap(2.0, 100, 50)) == {"w": [(2.0, 50.0, 25.0)]}
    assert tr.update(snap(3.0, 10, 0))["w"] == [(2.0, 50.0, 25.0)]  # counters reset (restart): skipped


@pytest.fixture
def sent(monkeypatch):
    """Every message a widget hands to its comm."""
    messages = []
    original = W.Widget._send

    def counting(self, msg, buffers=None):
        messages.append((type(self).__name__, msg.get("method"), len(buffers or [])))
        return original(self, msg, buffers)

    monkeypatch.setattr(W.Widget, "_send", counting)
    return messages


def test_publisher_sends_nothing_when_nothing_changed_and_only_what_changed(llm, sent):
    panels = default_panels()
    current = {"snap": fake_cluster_snapshot(llm, 1.0)}
    pub = Publisher(lambda: current["snap"], panels, max_hz=20)
    assert pub.poll_once() == len(panels)  # first poll renders everything
    sent.clear()
    assert pub.poll_once() == 0 and sent == []  # same snapshot: not one message
    changed = fake_cluster_snapshot(llm, 1.0)
    kv = changed["workers"][0]["snapshot"]["kv"]
    kv["page_states"] = list(kv["page_states"])
    kv["page_states"][0] = "owned" if kv["page_states"][0] != "owned" else "free"
    current["snap"] = changed
    assert pub.poll_once() == 1  # only the KV panel
    assert [name for name, _, _ in sent] == ["PageMap"]  # one message: state bytes + caption
    assert sent[0][2] == 1  # the bytes travel as a binary buffer, not JSON


def test_publisher_rate_is_bounded(llm, sent):
    panels = default_panels()
    counter = iter(range(10**9))

    def source():  # a snapshot that changes on every poll
        snap = fake_cluster_snapshot(llm, float(next(counter)))
        snap["workers"][0]["snapshot"]["kv"]["page_states"][0] = "owned" if snap["time"] % 2 else "free"
        return snap

    # The bound is on polls per second of the window the publisher really ran, measured
    # here: a fixed sleep(1.0) overslept on a busy machine and counted a longer window.
    # It runs until it has polled 20 times (a deadline, not a speed), so the bound is
    # checked over a window where the limiter had something to limit.
    started = time.monotonic()
    pub = Publisher(source, panels, max_hz=20).start()
    deadline = started + 60
    while pub.polls < 20:
        assert time.monotonic() < deadline, f"only {pub.polls} polls in 60 s"
        time.sleep(0.01)
    pub.stop()
    elapsed = time.monotonic() - started
    # Each poll starts at least 1/max_hz after the one before: at most 20 * elapsed + 1.
    assert pub.polls <= 20 * elapsed + 1, (pub.polls, elapsed)
    # per poll at most one message per HTML widget the panels own (queues, KV caption +
    # image, router, speculative, headline) and plotly's four per figure update (the edit,
    # its reset and two edit ids) for the two throughput figures: far below Jupyter's ~1000/s
    assert len(sent) <= pub.polls * (6 + 2 * 4) and len(sent) / elapsed < 300
    with pytest.raises(ValueError, match="max_hz"):
        Publisher(source, panels, max_hz=60)


def test_workbench_launch_errors_show_in_the_form(sent):
    wb = Workbench(model="no-such-model-anywhere", devices=["cpu"])
    wb.runner.launch(wb.launcher.options())
    deadline = time.monotonic() + 30
    while wb.runner.phase == "starting" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert wb.runner.phase == "failed" and "no-such-model-anywhere" in wb.runner.error
    wb.publisher.poll_once()
    assert "failed" in wb.launcher.status.value and "no-such-model-anywhere" in wb.launcher.status.value
    assert "Traceback" not in wb.launcher.status.value
    assert wb.static_html() == "<i>no cluster running</i>"
    wb.close()


def test_divergence_explorer_shows_both_sides_and_topk(llm):
    from minivllm_widgets import DivergenceExplorer, report_html
    from minivllm_widgets.divergence import parse_options

    assert parse_options("gemv_max_rows=0, batch_invariant=true") == {"gemv_max_rows": 0, "batch_invariant": True}
    assert parse_options('{"gemv_max_rows": 4096}') == {"gemv_max_rows": 4096}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_options("gemv_max_rows")
    ex = DivergenceExplorer(llm, prompt="The capital of France is", a={"gemv_max_rows": 0},
                            b={"gemv_max_rows": 0}, max_tokens=6)
    report = ex.run()
    assert report is not None and not report.diverged  # identical settings never split
    assert "no divergence" in ex.tokens.value
    for rec in report.records:
        assert rec.a.text.replace("\n", "") in ex.tokens.value.replace("\n", "") or rec.a.text.strip() == ""
    assert ex.position.max == len(report.records)  # 1-based, as the texts count tokens
    ex.position.value = ex.position.max
    last = report.records[-1].a
    assert f"chose {last.text!r}".replace("'", "&#x27;") in ex.topk.value
    assert len(ex.margin_figure.data) == 2 and len(ex.margin_figure.data[0].y) == 6  # both sides, live plotly
    static = report_html(report)  # the static fallback: plotly figures, plotly.js inline once
    assert static.count("window.Plotly = Plotly") == 1 and "<svg" not in static.split("</script>", 1)[1]
    margins = plotly_html.figures(static)[0]
    assert [t["y"] for t in margins["data"]] == [[r.a.margin for r in report.records],
                                                 [r.b.margin for r in report.records]]
    assert "The runs agree on all 6 generated tokens" in ex.summary.value
    assert ex.model.disabled and Path(llm.info()["model_path"]).name in ex.model.value  # the LLM it runs
    ex.a.value = "gemv_max_rows"
    assert ex.run() is None and "KEY=VALUE" in ex.status.value  # a bad option is shown, not raised
    assert ex.report is None and ex.tokens.value == "" and ex.summary.value == ""  # the old report is gone


def _committed_report():
    """The committed GEMM-vs-GEMV case, as the DivergenceReport it was saved from."""
    import json as _json

    from minivllm.debug.divergence_report import (
        DivergenceReport,
        FirstDivergence,
        LayerDiff,
        PositionRecord,
        ReplayCheck,
        SideToken,
        TopToken,
    )

    d = _json.loads((REPO_ROOT / "data" / "divergence" / "smollm2-gemm-vs-gemv.json").read_text())
    def side(t):
        return None if t is None else SideToken(t["token_id"], t["text"], [TopToken(**x) for x in t["top"]],
                                                          t["margin"])
    def top(t):
        return None if t is None else TopToken(**t)
    fd = d["first_divergence"]
    return DivergenceReport(**{
        **d, "records": [PositionRecord(r["position"], side(r["a"]), side(r["b"])) for r in d["records"]],
        "first_divergence": FirstDivergence(**{**fd, "a_token": top(fd["a_token"]), "b_token": top(fd["b_token"])}),
        "layer_diffs": [LayerDiff(**x) for x in d["layer_diffs"]],
        "replay": ReplayCheck(**d["replay"]) if d["replay"] else None})


def test_explorer_explains_a_divergence_in_plain_words():
    from minivllm_widgets.divergence_story import TIE_RULE, summary_sentence
    from minivllm_widgets.divergence_views import tokens_html, topk_html

    report = _committed_report()
    fd = report.first_divergence
    text = summary_sentence(report)
    assert text.startswith(f"The runs agree for {fd.identical_tokens} tokens; at generated token {fd.position + 1} "
                           "side a picks")
    assert "logits" in text and "side b picks" in text and "hidden states already differed from" in text
    assert "KV cache before the split" in text  # GEMM vs GEMV prefill: the prompt's rows already differ
    # text, widget and report name one position: "generated token N", counted from 1
    said = f"generated token {fd.position + 1}"
    assert said in report.summary() and said in repr(report) and said in tokens_html(report)
    assert f"top-k logits at {said}" in topk_html(report, fd.position)
    chips = tokens_html(report)
    assert chips.count("minivllm-chip") >= len(report.records) and "display:inline;" in chips  # chips wrap, and touch
    if fd.identical_tokens > 40:
        assert "shared tokens folded" in chips
    # an exact tie is called one, with the rule that broke it
    rec = report.records[fd.position]
    rec.a.margin = 0.0
    rec.a.top[1].logit = rec.a.top[0].logit
    assert "exact tie" in summary_sentence(report) and TIE_RULE in summary_sentence(report)
    assert "exact tie" in topk_html(report, fd.position)


def test_divergence_explorer_side_form_builds_compares_sides():
    """Each side: engine, engine options, device, dtype; what Run passes to `compare` (parsed by
    debug.sides, the same checker compare uses), and the static views of a cross-engine report."""
    from minivllm.debug.sides import parse_side
    from minivllm_widgets.divergence import DivergenceExplorer, engine_choices
    from minivllm_widgets.divergence_story import summary_sentence
    from minivllm_widgets.divergence_views import layers_html

    ex = DivergenceExplorer(None, a={"gemv_max_rows": 0, "dtype": "bf16"}, b="transformers")
    assert ex.side("a") == {"gemv_max_rows": 0, "dtype": "bf16"} and ex.a_dtype.value == "bf16"
    assert ex.side("b") == {"engine": "transformers"} and ex.b.disabled and ex.b_dtype.disabled
    ex.b_engine.value, ex.b.value, ex.b_device.value = "minivllm", "gemv_max_rows=4096", "cpu"
    assert not ex.b.disabled and ex.side("b") == {"gemv_max_rows": 4096, "device": "cpu"}
    assert parse_side(ex.side("b"), "b").device.type == "cpu"
    assert {"minivllm", "transformers"} <= set(engine_choices())
    # A report between different computations: the layer note and where b first leaves a.
    report = _committed_report()
    report.first_divergence = None
    report.layer_note = "no split within 120 generated tokens: the table covers ..."
    report.first_layer_difference = {"layer": "layer 0", "layer_index": 1, "position": 3, "in_prompt": True}
    report.layer_diffs[-1].comparable = False
    report.layer_diffs[-1].prefix_rel_l2 = float("nan")
    view = layers_html(report)
    assert "no split within 120" in view and "b first leaves a at layer 0, sequence position 3" in view
    assert "not comparable" in view and "nan" not in view.split("<table", 1)[1].lower()
    for fig in plotly_html.figures(view):  # strict JSON: a NaN reaching plotly.js fails the parse
        assert plotly_html.finite_points(fig)
    assert "b first leaves a at layer 0" in summary_sentence(report)


def test_throughput_tracker_records_step_latency():
    tr = ThroughputTracker()
    def snap(t, d, idx, dur):
        return {"time": t, "workers": [{"name": "w", "snapshot": {
            "counters": {"decode_tokens": d, "prefill_tokens": 0}, "last_step": {"index": idx, "duration_s": dur}}}]}
    tr.update(snap(0.0, 0, 0, 0.0))  # no step yet: nothing
    tr.update(snap(1.0, 10, 5, 0.02))
    tr.update(snap(2.0, 10, 5, 0.02))  # idle: the same step again is not a new measurement
    tr.update(snap(3.0, 30, 9, 0.05))
    assert tr.step_ms == {"w": [(1.0, 20.0), (3.0, 50.0)]}


def test_throughput_is_smooth_when_polls_outpace_snapshots():
    """Snapshots every 0.25 s polled at 10 Hz: no saw-tooth between 0 and spikes."""
    tr = ThroughputTracker()
    def snap(t, d):
        return {"time": t, "workers": [{"name": "w", "snapshot": {"counters": {"decode_tokens": d,
                                                                                              "prefill_tokens": 0}}}]}
    for i in range(60):
        t = i * 0.1
        series = tr.update(snap(t, int(t / 0.25) * 10))  # 40 tok/s, counted in steps of 10
    rates = [v for t, v, _ in series["w"] if t >= 2.0]
    assert min(rates) > 30 and max(rates) < 50


def test_small_views_say_what_they_mean():
    from minivllm_widgets.composer import composer_html
    from minivllm_widgets.html_views import queues_html, router_html, throughput_static_html
    from minivllm_widgets.launcher import Launcher

    idle = queues_html({"cpu": {"state": "ready", "device": "cpu", "requests": []}})
    assert "preempted</div>" in idle and "idle" in idle  # not "0 preemptedidle"
    decision = {"request_id": "r1", "policy": "cost", "reason": "cost", "chosen": "a", "candidates": [
        {"worker": "a", "healthy": True, "active": 1, "queued": 0, "cached": 16, "prefill_s": 0.00012272300000404357,
         "decode_s": 2.0, "finish_s": 2.5, "score": 2.5}]}
    router = router_html({"policy": "cost", "decisions": [decision]})
    assert "123 µs" in router and "2 s" in router and "16 tokens" in router and "0.000122723" not in router
    split = {"prefill": "a", "decode": "b", "transfer_tokens": 992, "transfer_bytes": 45711360,
             "link_mb_per_s": 1000.0, "prefill_s": 0.55, "transfer_s": 0.04571136, "decode_s": 2.68571136,
             "drain_s": 2.09, "score": 2.68571136, "break_even_ms_per_token": 0.4525877}
    view = router_view({"router": {"policy": "cost+split", "decisions": [
        {**decision, "candidates": [], "split": {"prefill": "a", "decode": "b"}, "split_candidates": [split]}]},
        "workers": []})
    router = router_html(view)
    assert "✔ a → b: prefill 550 ms + transfer 45.7 ms (45.7 MB at 1e+03 MB/s)" in router
    assert "<b>2.69 s</b> (break-even 0.453 ms/token)" in router
    chart = throughput_static_html({"w": [(0.0, 10.0, 0.0), (30.0, 20.0, 0.0)]}, {})
    (decode,) = plotly_html.figures(chart)  # the latency chart has no point: a line of text, no empty figure
    assert decode["data"][0]["y"] == [10.0, None, 20.0] and "step latency" in chart and "no data" in chart
    rows = (None, (("r1", "cpu", "", "stop", 0, "completion"), ("r2", "cpu", "a\nb", "length", 2, "chat")))
    shown = composer_html(rows)
    assert "0 tokens: the model ended at once" in shown and "try chat" in shown and "pre-wrap" in shown
    launcher = Launcher("smollm2-135m", ["cpu:1", "cpu:1"])
    assert launcher.options()["devices"] == ["cpu:1", "cpu:1"]
    launcher.cpu_count.value, launcher.cpu_threads.value = 3, 0
    assert launcher.options()["devices"] == ["cpu", "cpu", "cpu"]


def test_two_requests_on_one_prefix_share_its_pages(llm):
    """A real prefix hit: while both run, the common full pages have two holders."""
    engine = llm.engine
    ps = engine.pool.page_size
    common = llm.tokenizer.encode(
        "You are a patient teacher. Explain one idea in a short paragraph, with one example. " * 3
    )
    a = engine.add_request(common + llm.tokenizer.encode(" Gravity."), SamplingParams(temperature=0, max_tokens=32))
    for _ in range(4):
        engine.step()  # a's prompt is in and published (incremental publication)
    b = engine.add_request(common + llm.tokenizer.encode(" Recursion."), SamplingParams(temperature=0, max_tokens=32))
    engine.step()
    try:
        snap = fake_cluster_snapshot(llm, 1.0)
        kv = kv_view(snap)["cpu"]
        shared_pages = len(common) // ps
        assert shared_pages >= 3
        assert kv["counts"]["shared"] == shared_pages, kv["counts"]
        assert kv["hits"] >= 1 and kv["restored_tokens"] >= shared_pages * ps
        assert sum(kv["counts"].values()) == engine.pool.num_pages
    finally:
        for rid in (a, b):
            engine.release(rid)


def test_kv_map_costs_one_message_of_at_most_12_kb_at_10k_pages(llm, monkeypatch):
    """The budget: one message per worker update, state bytes in a binary buffer."""
    import json as _json

    from minivllm_widgets.page_map_widget import PageMap
    from minivllm_widgets.panels import KVPanel

    assert PageMap is not None, "anywidget is part of the notebook extra"
    sizes = []
    original = W.Widget._send

    def measuring(self, msg, buffers=None):
        sizes.append((type(self).__name__, len(_json.dumps(msg, default=str)) + sum(len(b) for b in buffers or [])))
        return original(self, msg, buffers)

    monkeypatch.setattr(W.Widget, "_send", measuring)
    rng = np.random.default_rng(0)
    n = 10_000

    def snapshot(seed_states):
        snap = fake_cluster_snapshot(llm, 1.0)
        states = [("free", "owned", "cached-idle", "shared")[i] for i in seed_states]
        refs = [0 if s == "free" else 1 if s in ("owned", "cached-idle") else int(rng.integers(2, 6)) for s in states]
        snap["workers"][0]["snapshot"]["kv"] = {**snap["workers"][0]["snapshot"]["kv"], "page_states": states,
                                                "ref_counts": refs, "total_pages": n}
        return snap

    panel = KVPanel("browser")
    states = rng.integers(0, 4, n)
    view = panel.view(snapshot(states))
    panel.render(view)
    panel.last_view = view
    sizes.clear()
    states[: n // 2] = rng.integers(0, 4, n // 2)  # half the pages change at once
    view = panel.view(snapshot(states))
    panel.render(view)
    assert [name for name, _ in sizes] == ["PageMap"], sizes
    assert sizes[0][1] <= 12 * 1024, sizes
    print(f"10k-page map update: one message of {sizes[0][1]} bytes")


def test_views_after_completion_and_after_close(smollm2_path):
    """Requests that returned are not shown running (static view included), and a closed
    workbench keeps the cluster's final state under a "stopped" mark."""
    from minivllm.serving import Cluster

    cluster = Cluster(str(smollm2_path), ["cpu:1"], max_model_len=256, max_active_requests=4).start()
    wb = Workbench(cluster=cluster)
    try:
        streams = [cluster.submit("Tell me about caches. " * 8 + t, SamplingParams(temperature=0, max_tokens=8))
                   for t in ("One.", "Two.")]
        for s in streams:
            s.result(timeout=300)
        static = wb.static_html()  # asks every worker for a fresh snapshot
        assert "0 running" in static and ">running<" not in static, static[-3000:]
        # the page map: a plotly heatmap, one cell per page, the free ones where the engine has them
        heatmap = next(f["data"][0] for f in plotly_html.figures(static) if f["data"][0]["type"] == "heatmap")
        cells = [v for row in heatmap["z"] for v in row if v is not None]
        states = cluster.snapshot(fresh=True)["workers"][0]["snapshot"]["kv"]["page_states"]  # idle: unchanged
        assert [c == 0 for c in cells] == [s == "free" for s in states]
        wb.publisher.poll_once()  # the latest (possibly older) snapshot: the ledger says they ended
        assert "0 running" in wb.panels[0].widget.value
    finally:
        wb.close()
    assert wb.runner.phase == "stopped" and not cluster.started
    assert "cluster stopped" in wb.live.widget.value
    final = wb.runner.final_snapshot["workers"][0]["snapshot"]["kv"]
    shown = kv_view(wb.runner.final_snapshot)["cpu"]["counts"]
    assert shown["free"] + shown["cached-idle"] == final["total_pages"]  # idle: nothing owned or shared
    assert "final state" in wb.static_html()


def test_png_page_map_fallback_draws_the_same_codes(llm):
    from minivllm_widgets.page_grid import render_codes_png
    from minivllm_widgets.page_map_widget import make_page_map
    from minivllm_widgets.panels import KVPanel

    panel = KVPanel("png")
    view = panel.view(fake_cluster_snapshot(llm, 1.0))
    panel.render(view)
    (png_map,) = panel._maps.values()
    assert png_map.image.value == render_codes_png(view["cpu"]["codes"])
    assert "0 shared" in png_map.caption.value and "pages of 16 tokens" in png_map.caption.value
    panel.last_view = view
    panel.render({"cpu": None})  # the worker restarts: no old picture under "no snapshot yet"
    assert png_map.image.value == b"" and "no snapshot yet" in png_map.caption.value
    with pytest.raises(ValueError, match="page_map"):
        make_page_map("svg")


def test_explorer_run_dims_the_old_report_at_once_and_the_bar_advances(llm, sent):
    """Run: the previous report is dimmed (its CSS class sent) before compare starts, the
    form is locked, the bar moves through compare's phases, and all is undone at the end."""
    from minivllm_widgets import DivergenceExplorer

    ex = DivergenceExplorer(llm, prompt="The capital of France is", a={"gemv_max_rows": 0}, b={"gemv_max_rows": 0},
                            max_tokens=3)
    ex.run()
    seen, original = [], ex._phase

    def watching(words, fraction):
        seen.append((time.monotonic() - started, "minivllm-stale" in ex.results._dom_classes, ex.run_button.disabled,
                     words, fraction))
        original(words, fraction)

    ex._phase = watching
    started = time.monotonic()
    sent.clear()
    ex.run()
    first_message = next(i for i, (name, _, _) in enumerate(sent) if name == "VBox")  # the results box's class
    assert first_message < 3, sent[:5]  # dimmed before anything else was sent
    assert seen[0][0] < 0.5 and seen[0][1] and seen[0][2], seen[0]  # within 0.5 s: dimmed, the form locked
    phases = [w for _, _, _, w, _ in seen]
    assert phases[1:] == ["loading side a", "loading side b", "generating a", "generating b"], phases
    fractions = [f for *_, f in seen]
    assert fractions == sorted(fractions) and fractions[-1] > fractions[0]  # the bar advances
    assert "minivllm-stale" not in ex.results._dom_classes and not ex.run_button.disabled
    assert ex.progress.value == 1.0 and ex.status.value == "done"


def test_explorer_greyed_fields_show_what_ran():
    """A transformers side runs in f32 whatever its greyed menu said before."""
    from minivllm_widgets import DivergenceExplorer

    ex = DivergenceExplorer(None, a={"dtype": "bf16"}, b="transformers")
    assert ex.b_dtype.disabled and ex.b_dtype.value == ""
    report = _committed_report()
    report.a_settings = {**report.a_settings, "engine": "minivllm", "dtype": "bf16"}
    report.b_settings = {"engine": "transformers", "device": "cpu", "dtype": "f32"}
    ex.show(report)
    assert ex.b_dtype.value == "f32" and ex.a_dtype.value == "bf16"
