"""The workbench in a real browser: JupyterLab on 127.0.0.1, driven by Playwright with
Debian's Chromium (/usr/bin/chromium; browsers cannot be downloaded here).

Opens the quickstart notebook, runs every cell, and checks what a user sees:
- the KV page map (a canvas painted in the browser from the page-state bytes) changes while
  the requests run, shows shared pages while three requests share a prefix, and at the end
  counts exactly the states of the final snapshot the notebook prints (the counts the canvas
  computed from the bytes it received, and the caption's);
- requests that returned are no longer shown as running, and the closed dashboard says so;
- the divergence explorer's summary sentence is there;
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
        frames, queue_texts, shared_seen = set(), set(), []
        final_text = None
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            state = _map_state(page)
            if state is not None:
                frames.add(json.dumps(state["counts"], sort_keys=True))
                if state["counts"].get("shared", 0) > 0:
                    shared_seen.append(state)
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
    # The speculative notebook's code columns keep their indentation.
    assert style["pre"] in ("left", "start") and style["column"] in ("left", "start"), style
    assert style["ws"] == "pre-wrap" and "\n    if n < 2:\n        return False" in style["text"], style
