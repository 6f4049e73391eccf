"""Every notebook in JupyterLab under Chromium (Playwright), run top to bottom as a user
runs it, and read through the page's DOM:
- the browser console logs no error and the page throws none;
- no cell shows an error output;
- the outputs show what the notebook expects (test_notebooks.missing_expected_outputs);
- every chart is a plotly one with data: each `.js-plotly-plot` element's own `data` (what
  plotly.js drew) has at least one trace with a finite point, and no trace holds NaN or
  infinity; every live chart of ours (`.minivllm-chart`) is such a plot;
- every static chart (`.minivllm-static-chart`: `show_static()`, `report_html`) is such a
  plotly plot too, drawn by the plotly.js its output carries; no hand-drawn SVG is left.

Slow (each notebook runs its own kernel, minutes on a small CPU): run it alone, e.g.
`timeout 3600 pytest -q tests/e2e/test_browser_notebooks.py`. Chromium and Playwright come
as in test_browser_workbench (installed there when missing, else the test skips saying why).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import REPO_ROOT
from test_browser_workbench import (
    ARTIFACTS,
    CHROMIUM,
    TOKEN,
    _ensure_chromium,
    _ensure_playwright,
    _free_port,
    _run_all,
)
from test_notebooks import missing_expected_outputs

NOTEBOOKS = sorted(p.name for p in (REPO_ROOT / "notebooks").glob("*.ipynb"))
PER_NOTEBOOK_S = 1200

CHART_CHECK = """() => {
    const bad = [];
    const plots = [...document.querySelectorAll('.jp-Notebook .js-plotly-plot')];
    for (const [i, el] of plots.entries()) {
        const traces = el.data || [];
        // y of lines and bars, z of heatmaps (the static KV page map)
        const values = traces.flatMap(t => [...(t.y || []), ...[...(t.z || [])].flat()])
            .filter(v => v !== null && v !== undefined);
        const numeric = values.filter(v => typeof v === 'number');
        if (!numeric.some(v => Number.isFinite(v))) bad.push(`plot ${i}: no finite point (${traces.length} traces)`);
        if (numeric.some(v => !Number.isFinite(v))) bad.push(`plot ${i}: NaN or infinity in its data`);
    }
    for (const el of document.querySelectorAll('.jp-Notebook .minivllm-chart'))
        // plotly draws into the widget's own element (which then carries js-plotly-plot) or inside it
        if (!el.matches('.js-plotly-plot') && !el.querySelector('.js-plotly-plot'))
            bad.push('a live chart that is not a plotly plot');
    const statics = [...document.querySelectorAll('.jp-Notebook .minivllm-static-chart')];
    for (const el of statics)  // plotly.js marks the div it drew into with js-plotly-plot
        if (!el.querySelector('.js-plotly-plot')) bad.push('a static chart that plotly.js did not draw');
    for (const svg of document.querySelectorAll('.jp-Notebook svg.minivllm-static-chart'))
        bad.push('a hand-drawn SVG chart');
    return {plots: plots.length, static: statics.length, bad: bad};
}"""


def _start_lab(root, log_path):
    port = _free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
                             f"--IdentityProvider.token={TOKEN}", f"--ServerApp.root_dir={root}",
                             "--ServerApp.disable_check_xsrf=True", "--allow-root", "--LabApp.news_url=",
                             "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
                            stdout=log, stderr=subprocess.STDOUT, cwd=root)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={TOKEN}", timeout=2)
            return proc, log, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                log.close()
                pytest.fail(f"JupyterLab did not start: {log_path.read_text()[-2000:]}")
            time.sleep(0.5)


def _kernel_busy_or_missing(url: str, notebook: str) -> bool:
    with urllib.request.urlopen(f"{url}/api/sessions?token={TOKEN}", timeout=10) as r:
        sessions = [s for s in json.loads(r.read()) if str(s.get("path", "")).endswith(notebook)]
    return not sessions or any((s.get("kernel") or {}).get("execution_state") != "idle" for s in sessions)


def _shutdown_sessions(url: str) -> None:
    with urllib.request.urlopen(f"{url}/api/sessions?token={TOKEN}", timeout=10) as r:
        sessions = json.loads(r.read())
    for s in sessions:
        req = urllib.request.Request(f"{url}/api/sessions/{s['id']}?token={TOKEN}", method="DELETE")
        urllib.request.urlopen(req, timeout=30)


def _wait_until_settled(page, url: str, notebook: str) -> None:
    """Until no cell is running or queued ([*]) and the kernel is idle, for 3 s running:
    every cell ran, or Run All stopped at an error (the saved file says which)."""
    deadline = time.monotonic() + PER_NOTEBOOK_S
    settled = 0
    while settled < 3:
        # textContent: JupyterLab does not lay out cells outside the view, and their innerText is ""
        prompts = page.eval_on_selector_all(".jp-Notebook .jp-CodeCell .jp-InputPrompt",
                                            "els => els.map(e => e.textContent)")
        busy = any("*" in p for p in prompts) or _kernel_busy_or_missing(url, notebook)
        settled = 0 if busy else settled + 1
        assert time.monotonic() < deadline, f"{notebook} did not finish in {PER_NOTEBOOK_S} s: {prompts}"
        time.sleep(1.0)


def _saved_cells(page, root, notebook: str) -> list[dict]:
    """The notebook as the page holds it, saved to disk (outputs, execution counts)."""
    before = (root / notebook).stat().st_mtime_ns
    page.click(f"li.lm-TabBar-tab:has-text('{notebook}')")
    page.keyboard.press("Control+s")
    deadline = time.monotonic() + 30
    while (root / notebook).stat().st_mtime_ns == before and time.monotonic() < deadline:
        time.sleep(0.2)
    while True:  # the save may still be under way (outputs with plotly.js inline are megabytes)
        try:
            return json.loads((root / notebook).read_text())["cells"]
        except json.JSONDecodeError:
            assert time.monotonic() < deadline, f"{notebook}: the saved file never became whole JSON"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def lab(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("lab")
    for name in NOTEBOOKS:  # copies: the page may autosave outputs, never into the repository
        shutil.copy(REPO_ROOT / "notebooks" / name, root)
    (root / "data").symlink_to(REPO_ROOT / "data")  # the notebooks find data/ above their folder
    proc, log, url = _start_lab(root, root.parent / "jupyter-notebooks.log")
    yield url, root
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_notebook_in_chromium_has_no_console_error_and_only_finite_plotly_charts(lab, notebook):
    lab, root = lab
    _ensure_chromium()
    sync_playwright = _ensure_playwright()
    ARTIFACTS.mkdir(exist_ok=True)
    console, page_errors = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.on(
            "console",
            lambda m: console.append(f"{m.text} ({m.location.get('url', '')})") if m.type == "error" else None,
        )
        page.on("pageerror", lambda e: page_errors.append(str(e)))
        page.goto(f"{lab}/lab/workspaces/{notebook.split('.')[0]}/tree/{notebook}?reset&token={TOKEN}")
        _run_all(page, lab, notebook)
        _wait_until_settled(page, lab, notebook)
        page.wait_for_timeout(1500)  # the last widget messages and plotly's drawing
        charts = page.evaluate(CHART_CHECK)
        cells = [c for c in _saved_cells(page, root, notebook) if c["cell_type"] == "code"]
        page.screenshot(path=str(ARTIFACTS / f"notebook-{notebook.split('.')[0]}.png"), full_page=False)
        if charts["plots"]:  # the first chart, for a look at what was drawn
            plot = page.locator(".jp-Notebook .js-plotly-plot").first
            plot.scroll_into_view_if_needed()
            plot.screenshot(path=str(ARTIFACTS / f"notebook-{notebook.split('.')[0]}-chart.png"))
        browser.close()
    _shutdown_sessions(lab)
    errors = [
        f"{o.get('ename')}: {o.get('evalue')}" for c in cells for o in c["outputs"] if o["output_type"] == "error"
    ]
    assert not errors, f"{notebook}: error outputs: {errors}"
    committed = json.loads((REPO_ROOT / "notebooks" / notebook).read_text())
    missing = missing_expected_outputs(committed.get("metadata", {}), [o for c in cells for o in c["outputs"]])
    assert not missing, f"{notebook}: {missing} missing from the outputs"
    assert all(c["execution_count"] for c in cells), f"{notebook}: cells that never ran: " + str(
        ["".join(c["source"])[:60] for c in cells if not c["execution_count"]])
    assert not page_errors, f"{notebook}: the page threw: {page_errors}"
    assert not console, f"{notebook}: console errors: {console}"
    assert not charts["bad"], f"{notebook}: {charts}"
    source = "".join("".join(c["source"]) for c in cells)
    if any(k in source for k in ("Workbench(", "DivergenceExplorer(", "figure(")):  # it draws charts: plotly ones
        assert charts["plots"] >= 1, f"{notebook}: no plotly chart on the page ({charts})"
    if any(k in source for k in ("report_html(", "show_static()")):  # static renders: plotly figures too
        assert charts["static"] >= 1, f"{notebook}: no static plotly chart on the page ({charts})"
