"""The workbench in a real browser: JupyterLab on 127.0.0.1, driven by Playwright with
Debian's Chromium (/usr/bin/chromium; browsers cannot be downloaded here).

Opens the quickstart notebook, runs every cell, and checks what a user sees:
- the KV page map (a canvas painted in the browser from the page-state bytes) changes while
  the requests run, shows shared pages while three requests share a prefix, and at the end
  counts exactly the states of the final snapshot the notebook prints (the counts the canvas
  computed from the bytes it received, and the caption's);
- requests that returned are no longer shown as running, and the closed dashboard says so;
- hovering a page of the map names its state, request holders, ref count, cached or not and
  the requests that hold it: every page's hover against the engine's own final snapshot
  (read from the notebook's kernel through a second client), and while three requests share
  a prefix, the shared pages' owners against those requests' ids and their ref counts;
- "open beside the notebook" puts the dashboard in a JupyterLab side panel (sidecar) that
  holds its plotly figures, with data;
- the static fallback (`wb.show_static()`) draws plotly figures;
- the divergence explorer's summary sentence is there; after Run the old report is dimmed
  within 0.5 s of the click (timed in the browser) and the progress bar advances before the
  new report lands;
- the speculative notebook's side-by-side code keeps its indentation (computed style: left
  aligned, whitespace kept), from that notebook's own cell.
Screenshots land in test-artifacts/ (copies for the README live in docs/screenshots/). The
test installs what it lacks (apt `chromium`, pip `playwright`) and skips with the reason
when it cannot.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import REPO_ROOT

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = REPO_ROOT / "test-artifacts"
TOKEN = "minivllm-browser-test"


def _ensure_chromium() -> None:
    if os.path.exists(CHROMIUM):
        return
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.skip(
            "needs Debian's chromium at /usr/bin/chromium (apt-get install chromium), and cannot install it here"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "chromium"],
    ):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            pytest.skip(f"could not install chromium ({' '.join(cmd)}): {done.stderr.strip()[-300:]}")
    if not os.path.exists(CHROMIUM):
        pytest.skip("apt-get installed chromium but /usr/bin/chromium is missing")


def _ensure_playwright():
    try:
        from playwright.sync_api import sync_playwright  # noqa: F401
    except ImportError:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "playwright"], capture_output=True, text=True, timeout=600
        )
        if done.returncode != 0:
            pytest.skip(f"could not pip install playwright: {done.stderr.strip()[-300:]}")
    from playwright.sync_api import sync_playwright

    return sync_playwright


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def jupyter_lab(tmp_path, smollm2_path):
    root = tmp_path / "lab"
    root.mkdir()
    shutil.copy(REPO_ROOT / "notebooks" / "quickstart.ipynb", root)
    _side_by_side_notebook(root / "side_by_side.ipynb")
    port = _free_port()
    log = open(tmp_path / "jupyter.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyter",
            "lab",
            "--no-browser",
            "--ip=127.0.0.1",
            f"--port={port}",
            f"--IdentityProvider.token={TOKEN}",
            f"--ServerApp.root_dir={root}",
            "--ServerApp.disable_check_xsrf=True",
            "--allow-root",
            "--LabApp.news_url=",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=root,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={TOKEN}", timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                log.close()
                pytest.fail(f"JupyterLab did not start: {(tmp_path / 'jupyter.log').read_text()[-2000:]}")
            time.sleep(0.5)
    yield url
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def _wait_for_kernel_connected(url: str, notebook: str = "quickstart.ipynb", timeout_s: float = 180.0) -> None:
    """Until the server reports the notebook's kernel idle with a client (the page's
    websocket) connected to it."""
    import json

    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(f"{url}/api/sessions?token={TOKEN}", timeout=10) as r:
            sessions = json.loads(r.read())
        kernels = [s.get("kernel") or {} for s in sessions if str(s.get("path", "")).endswith(notebook)]
        if any(k.get("execution_state") == "idle" and k.get("connections", 0) >= 1 for k in kernels):
            return
        assert time.monotonic() < deadline, f"the notebook's kernel never connected: {sessions}"
        time.sleep(0.2)


INDENTED = "def is_prime(n):\n    if n < 2:\n        return False\n    return all(n % d for d in range(2, n))\n"


def _side_by_side_notebook(path: Path) -> None:
    """The speculative notebook's side-by-side cell, fed indented code instead of model output."""
    spec = json.loads((REPO_ROOT / "notebooks" / "speculative.ipynb").read_text())
    cell = next("".join(c["source"]) for c in spec["cells"] if "sampled[D, SEEDS[0]]" in "".join(c["source"]))
    setup = f"SEEDS = [1]\nsampled = {{(D, 1): {INDENTED!r} for D in (0.0, 0.5, 1.0)}}"

    def code(src: str) -> dict:
        return {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": src}

    path.write_text(json.dumps({"cells": [code(setup), code(cell)], "metadata": spec["metadata"], "nbformat": 4,
                                "nbformat_minor": 5}))


def _run_all(page, url: str, notebook: str) -> None:
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator, .jp-KernelStatus, .jp-Toolbar", timeout=60_000)
    page.wait_for_function("() => document.querySelector('.jp-Notebook') !== null", timeout=60_000)
    _wait_for_kernel_connected(url, notebook)  # not a fixed sleep: the page's kernel is up and attached
    # "Run All Cells" acts on the active tab: make sure it is this notebook's.
    page.click(f"li.lm-TabBar-tab:has-text('{notebook}')")
    page.click("li.lm-MenuBar-item:has-text('Run')")
    page.click("li.lm-Menu-item:has-text('Run All Cells')")


def _map_state(page) -> dict:
    return page.evaluate("""() => {
        const el = document.querySelector('.minivllm-kv .minivllm-page-map');
        const caption = {};
        for (const s of document.querySelectorAll('.minivllm-kv .minivllm-kv-count'))
            caption[s.dataset.state] = parseInt(s.textContent);
        return el ? {counts: JSON.parse(el.dataset.counts || '{}'), pages: el.dataset.pages, caption: caption,
                     text: el.innerText} : null;
    }""")


def _kernel_print(url: str, notebook: str, code: str, timeout_s: float = 120.0) -> str:
    """Runs `code` in the notebook's own kernel as a second client over the server's
    websocket and returns what it printed (the notebook shows nothing of it: JupyterLab
    routes outputs to the client that asked)."""
    import datetime
    import uuid

    import websocket  # websocket-client, a dependency of jupyter_server

    with urllib.request.urlopen(f"{url}/api/sessions?token={TOKEN}", timeout=10) as r:
        kernel = next(s["kernel"]["id"] for s in json.loads(r.read()) if str(s.get("path", "")).endswith(notebook))
    session, msg_id = uuid.uuid4().hex, uuid.uuid4().hex
    ws = websocket.create_connection(
        f"{url.replace('http', 'ws', 1)}/api/kernels/{kernel}/channels?token={TOKEN}&session_id={session}",
        timeout=timeout_s)
    try:
        ws.send(json.dumps({
            "header": {"msg_id": msg_id, "username": "browser-test", "session": session, "version": "5.3",
                       "msg_type": "execute_request", "date": datetime.datetime.now(datetime.timezone.utc).isoformat()},
            "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
            "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {},
                        "allow_stdin": False, "stop_on_error": True}}))
        out, deadline = [], time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            frame = ws.recv()
            if isinstance(frame, bytes):  # a message with binary buffers (the page map's bytes): not ours
                continue
            msg = json.loads(frame)
            if (msg.get("parent_header") or {}).get("msg_id") != msg_id:
                continue
            kind = msg["header"]["msg_type"]
            if kind == "stream":
                out.append(msg["content"]["text"])
            elif kind == "error":
                raise AssertionError(f"kernel: {msg['content']['ename']}: {msg['content']['evalue']}")
            elif kind == "status" and msg["content"]["execution_state"] == "idle":
                return "".join(out)
        raise AssertionError(f"the kernel did not answer in {timeout_s} s")
    finally:
        ws.close()


def _wait_for_kernel_idle(url: str, notebook: str, timeout_s: float = 600.0) -> None:
    """Until the notebook's kernel has been idle for 3 polls running (every queued cell ran)."""
    deadline, idle = time.monotonic() + timeout_s, 0
    while idle < 3:
        with urllib.request.urlopen(f"{url}/api/sessions?token={TOKEN}", timeout=10) as r:
            states = [(s.get("kernel") or {}).get("execution_state") for s in json.loads(r.read())
                      if str(s.get("path", "")).endswith(notebook)]
        idle = idle + 1 if states and all(st == "idle" for st in states) else 0
        assert time.monotonic() < deadline, f"the kernel never went idle: {states}"
        time.sleep(0.5)


HOVER = re.compile(r"page (\d+): ([a-z-]+), (\d+) request holder\(s\), ref count (\d+), "
                   r"(in the prefix cache|not cached)(?:; requests: (.+))?$")


def _hover_every_page(page) -> list[tuple]:
    """Every page's hover text, read in one go (one frame): a mousemove over each cell's
    centre, as the mouse would send it, parsed into (page, state, holders, ref count,
    cached, owners)."""
    from minivllm_widgets.page_grid import grid_layout

    pages = int(page.get_attribute(".minivllm-kv .minivllm-page-map", "data-pages"))
    pitch, columns, _ = grid_layout(pages)
    texts = page.evaluate("""([pitch, columns]) => {
        const el = document.querySelector('.minivllm-kv .minivllm-page-map');
        const canvas = el.querySelector('canvas'), rect = canvas.getBoundingClientRect();
        const out = [];
        for (let i = 0; i < Number(el.dataset.pages); i++) {
            const x = rect.left + (i % columns + 0.5) * pitch, y = rect.top + (Math.floor(i / columns) + 0.5) * pitch;
            canvas.dispatchEvent(new MouseEvent('mousemove', {clientX: x, clientY: y}));
            out.push(canvas.title);
        }
        return out;
    }""", [pitch, columns])
    parsed = []
    for i, text in enumerate(texts):
        m = HOVER.match(text)
        assert m and int(m.group(1)) == i, (i, text)
        owners = tuple(m.group(6).split(", ")) if m.group(6) else ()
        parsed.append((i, m.group(2), int(m.group(3)), int(m.group(4)), m.group(5) == "in the prefix cache", owners))
    return parsed


def _explorer_run_timed(page) -> dict:
    """Click the explorer's Run (max tokens 8) and time, in the browser, when the old report
    is dimmed (or cleared) and every value the progress bar shows until the report is back."""
    root = page.locator("xpath=//div[contains(@class,'minivllm-divergence-results')]/..").first
    max_tokens = root.locator("div.widget-inline-hbox", has_text="max tokens").locator("input").first
    max_tokens.fill("8")
    max_tokens.press("Tab")  # the widget syncs on change
    page.wait_for_timeout(500)
    page.evaluate("""() => {
        const results = document.querySelector('.minivllm-divergence-results');
        const root = results.parentElement;
        const bar = root.querySelector('.widget-hprogress .progress-bar');
        const t = window.__explorer = {click: null, dimmed: null, back: null, progress: []};
        const dim = () => parseFloat(getComputedStyle(results).opacity) <= 0.5 || results.innerText.trim() === '';
        for (const b of root.querySelectorAll('button'))
            if (b.textContent.trim() === 'Run') b.addEventListener('click', () => { t.click = performance.now(); },
                                                                   {capture: true});
        new MutationObserver(() => {
            if (t.click === null) return;
            const stale = results.classList.contains('minivllm-stale');
            if (stale && t.dimmed === null) t.dimmed = performance.now();
            if (!stale && t.dimmed !== null && t.back === null) t.back = performance.now();
        }).observe(results, {attributes: true, attributeFilter: ['class'], childList: true, subtree: true});
        new MutationObserver(() => {
            if (t.click !== null && t.back === null) t.progress.push(parseFloat(bar.style.width));
        }).observe(bar, {attributes: true, attributeFilter: ['style']});
        window.__dimmedNow = dim;
    }""")
    root.locator("button", has_text="Run").first.click()
    # the old report dimmed (opacity at most 0.5: the class, its transition under way) or cleared
    page.wait_for_function("() => window.__dimmedNow()", timeout=500)
    dimmed_in = page.evaluate("() => performance.now() - window.__explorer.click")
    page.wait_for_function("() => window.__explorer.back !== null", timeout=600_000)
    page.wait_for_function("() => document.querySelector('.minivllm-divergence-summary') !== null", timeout=60_000)
    return {**page.evaluate("() => window.__explorer"), "dimmed_in": dimmed_in}


def _screenshot(page, selector: str, name: str, *, vbox: bool = True, max_height: int = 800) -> None:
    """The top `max_height` px of the widget box around `selector` (or of its parent): small PNGs."""
    inner = page.locator(selector).first
    box = inner.locator("xpath=ancestor::div[contains(@class,'widget-vbox')][1]" if vbox else "xpath=..")
    page.set_viewport_size({"width": 1400, "height": max_height + 400})
    box.evaluate("el => el.scrollIntoView({block: 'start'})")  # its top at the top of the notebook's scroller
    page.wait_for_timeout(300)
    b = box.bounding_box()
    page.screenshot(
        path=str(ARTIFACTS / name),
        clip={"x": b["x"], "y": max(0, b["y"]), "width": b["width"], "height": min(b["height"], max_height)},
    )


def test_quickstart_dashboard_shows_the_truth_in_chromium(jupyter_lab):
    _ensure_chromium()
    sync_playwright = _ensure_playwright()
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"{jupyter_lab}/lab/tree/quickstart.ipynb?token={TOKEN}")
        _run_all(page, jupyter_lab, "quickstart.ipynb")
        # The dashboard appears once the worker is up; then the requests run for a while.
        page.wait_for_selector(".minivllm-kv .minivllm-page-map canvas", timeout=600_000)
        queues = page.wait_for_selector(".minivllm-queues", timeout=60_000)
        frames, queue_texts, shared_seen, shared_hover = set(), set(), [], []
        final_text = None
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            state = _map_state(page)
            if state is not None:
                frames.add(json.dumps(state["counts"], sort_keys=True))
                if state["counts"].get("shared", 0) > 0:
                    shared_seen.append(state)
                    if not shared_hover:  # every page's hover in one frame while requests share
                        shared_hover = _hover_every_page(page)
            queue_texts.add(queues.inner_text())
            out = page.locator(".jp-OutputArea-output:has-text('final KV page states')")
            if out.count():
                final_text = out.first.inner_text()
                break
            time.sleep(0.3)
        assert final_text is not None, "the quickstart never printed its final KV page states"
        page.wait_for_selector(".minivllm-live[data-phase='stopped']", timeout=120_000)
        page.wait_for_timeout(500)  # the final frame's messages
        final_map = _map_state(page)
        final_queues = queues.inner_text()
        _screenshot(page, ".minivllm-live", "workbench-quickstart.png")  # the dashboard, final state
        summary = page.wait_for_selector(".minivllm-divergence-summary", timeout=60_000)
        summary_text = summary.inner_text()
        _screenshot(page, ".minivllm-divergence-summary", "divergence-explorer.png")
        _wait_for_kernel_idle(jupyter_lab, "quickstart.ipynb")  # every cell ran; clicks are answered at once
        page.wait_for_function("() => document.querySelectorAll("
                               "'.jp-Notebook .minivllm-static-chart .js-plotly-plot').length >= 1", timeout=60_000)
        static_plots = page.evaluate("() => [...document.querySelectorAll('.jp-Notebook .minivllm-static-chart "
                                     ".js-plotly-plot')].map(el => (el.data || [])"
                                     ".flatMap(t => [...(t.y || []), ...[...(t.z || [])].flat()]))")
        # The engine's own final snapshot and the shared requests' ids, from the notebook's kernel.
        engine = json.loads(_kernel_print(jupyter_lab, "quickstart.ipynb", (
            "import json as _json\n"
            "_s = wb.runner.final_snapshot['workers'][0]['snapshot']\n"
            "print(_json.dumps({'states': _s['kv']['page_states'], 'refs': _s['kv']['ref_counts'],"
            " 'tables': [(r['id'], r['block_table']) for q in ('running', 'waiting', 'preempted')"
            " for r in _s['queues'][q]], 'shared_ids': [s.request_id for s in rest]}))")))
        final_hover = _hover_every_page(page)
        # one real mouse move over a cached page: the canvas's own tooltip says the same
        cached_page = next((h for h in final_hover if h[4]), final_hover[0])
        pages = int(page.get_attribute(".minivllm-kv .minivllm-page-map", "data-pages"))
        from minivllm_widgets.page_grid import grid_layout

        pitch, columns, _ = grid_layout(pages)
        box = page.locator(".minivllm-kv .minivllm-page-map canvas").first
        box.scroll_into_view_if_needed()
        b = box.bounding_box()
        page.mouse.move(b["x"] + (cached_page[0] % columns + 0.5) * pitch,
                        b["y"] + (cached_page[0] // columns + 0.5) * pitch)
        real_title = box.get_attribute("title")
        # Open beside: the dashboard in JupyterLab's side panel, with its plotly figures.
        page.locator(".minivllm-dashboard button", has_text="open beside the notebook").first.click()
        page.wait_for_selector(".jupyterlab-sidecar .minivllm-dashboard .js-plotly-plot", timeout=60_000)
        page.wait_for_timeout(500)
        beside = page.evaluate("""() => ({
            tabs: [...document.querySelectorAll('.lm-TabBar-tab')].map(t => t.textContent.trim()),
            in_notebook: !!document.querySelector('.jp-Notebook .jupyterlab-sidecar'),
            plots: [...document.querySelectorAll('.jupyterlab-sidecar .minivllm-dashboard .js-plotly-plot')]
                .map(el => (el.data || []).flatMap(t => [...(t.y || [])]).filter(v => typeof v === 'number')),
            map: !!document.querySelector('.jupyterlab-sidecar .minivllm-page-map canvas')})""")
        explorer = _explorer_run_timed(page)

        # A fresh page on a reset workspace: otherwise JupyterLab restores the quickstart tab
        # next to this one and may leave it active, and "Run All Cells" reruns the quickstart
        # (seen on CI: the side-by-side output never appeared).
        page.close()
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"{jupyter_lab}/lab/workspaces/side-by-side/tree/side_by_side.ipynb?reset&token={TOKEN}")
        _run_all(page, jupyter_lab, "side_by_side.ipynb")
        pre = page.wait_for_selector(".minivllm-side-by-side pre", timeout=300_000)
        style = pre.evaluate("el => { const s = getComputedStyle(el); const c = getComputedStyle(el.parentElement);"
                             " return {pre: s.textAlign, column: c.textAlign, ws: s.whiteSpace, text: el.innerText}; }")
        _screenshot(page, ".minivllm-side-by-side", "speculative-side-by-side.png", vbox=False)
        browser.close()

    assert len(frames) >= 2, "the KV page map never changed while requests ran"
    assert any("running" in t and "0 running" not in t for t in queue_texts), queue_texts
    assert shared_seen, "three requests on one prefix never showed shared pages"
    # The final frame: what the canvas painted equals the snapshot the notebook printed.
    printed = ast.literal_eval(re.search(r"final KV page states: (\{.*?\})", final_text).group(1))
    assert set(printed) <= {"free", "cached-idle"}, printed  # all requests have ended
    expected = {"free": printed.get("free", 0), "owned": 0, "cached-idle": printed.get("cached-idle", 0),
                "cached-in-use": 0, "shared": 0}
    assert final_map["counts"] == expected, (final_map, printed)
    assert final_map["caption"] == expected, (final_map, printed)
    assert int(final_map["pages"]) == sum(printed.values())
    assert expected["cached-idle"] > 0  # the shared prefix stays cached
    # Requests that returned are not shown running; the stopped cluster is marked.
    assert "0 running" in final_queues and "\trunning\t" not in final_queues, final_queues
    assert re.search(r"[1-9]\d*/\d+ prefix hits", final_map["text"]), final_map["text"]
    assert summary_text.startswith("The runs agree"), summary_text
    # KV hover, final frame: every page against the engine's own snapshot (state, ref count,
    # cached or not, the requests whose block tables hold it).
    owners = {}
    for request_id, table in engine["tables"]:
        for p in table:
            owners.setdefault(p, []).append(request_id)
    assert len(final_hover) == len(engine["states"])
    for i, state, holders, refs, cached, who in final_hover:
        assert (state, refs) == (engine["states"][i], engine["refs"][i]), (i, final_hover[i])
        assert cached == (state in ("cached-idle", "cached-in-use", "shared")), final_hover[i]
        assert holders == refs - cached and sorted(who) == sorted(owners.get(i, [])), final_hover[i]
    assert HOVER.match(real_title) and real_title.startswith(f"page {cached_page[0]}: cached-idle"), real_title
    # KV hover while three requests share the prefix: each shared page names its holders, the
    # prefix cache holds one more reference, and the holders are among those requests.
    shared_pages = [h for h in shared_hover if h[1] == "shared"]
    assert shared_pages, "no shared page in the frame that was hovered"
    for i, _state, holders, refs, cached, who in shared_pages:
        assert holders >= 2 and refs == holders + 1 and cached, shared_hover[i]
        assert len(who) == holders and set(who) <= set(engine["shared_ids"]), (shared_hover[i], engine["shared_ids"])
    # Open beside: a side panel outside the notebook, holding the dashboard's plotly figures.
    assert "minivllm dashboard" in beside["tabs"] and not beside["in_notebook"], beside
    assert beside["map"] and beside["plots"] and any(beside["plots"]), beside
    # The static fallback: plotly figures with finite data.
    assert static_plots and all(any(isinstance(v, (int, float)) for v in ys) for ys in static_plots), static_plots
    # The explorer while running: dimmed within 0.5 s of the click, the bar advancing before
    # the new report lands.
    assert explorer["click"] is not None and explorer["dimmed_in"] < 500, explorer
    bar = explorer["progress"]
    print(f"explorer: report dimmed {explorer['dimmed'] - explorer['click']:.0f} ms after the click (seen by the "
          f"wait at {explorer['dimmed_in']:.0f} ms), progress {bar}, report back after "
          f"{explorer['back'] - explorer['click']:.0f} ms")
    assert any(b > a for a, b in zip(bar, bar[1:])), explorer
    # The speculative notebook's code columns keep their indentation.
    assert style["pre"] in ("left", "start") and style["column"] in ("left", "start"), style
    assert style["ws"] == "pre-wrap" and "\n    if n < 2:\n        return False" in style["text"], style
