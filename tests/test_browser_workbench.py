"""The workbench in a real browser: JupyterLab on 127.0.0.1, driven by Playwright with
Debian's Chromium (/usr/bin/chromium; browsers cannot be downloaded here).

Opens the quickstart notebook, runs every cell, and checks that the KV page map and the
queue panel render and change while the dashboard's requests run. The screenshot lands
in test-artifacts/workbench-quickstart.png. The test installs what it lacks (apt
`chromium`, pip `playwright`) and skips with the reason when it cannot.
"""

from __future__ import annotations

import os
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
        pytest.skip("needs Debian's chromium at /usr/bin/chromium (apt-get install chromium), and cannot install it here")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "chromium"]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            pytest.skip(f"could not install chromium ({' '.join(cmd)}): {done.stderr.strip()[-300:]}")
    if not os.path.exists(CHROMIUM):
        pytest.skip("apt-get installed chromium but /usr/bin/chromium is missing")


def _ensure_playwright():
    try:
        from playwright.sync_api import sync_playwright  # noqa: F401
    except ImportError:
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "playwright"], capture_output=True, text=True,
                              timeout=600)
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
    port = _free_port()
    log = open(tmp_path / "jupyter.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
                             f"--IdentityProvider.token={TOKEN}", f"--ServerApp.root_dir={root}",
                             "--ServerApp.disable_check_xsrf=True", "--allow-root", "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
                            stdout=log, stderr=subprocess.STDOUT, cwd=root)
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


def _wait_for_kernel_connected(url: str, timeout_s: float = 180.0) -> None:
    """Until the server reports the notebook's kernel idle with a client (the page's
    websocket) connected to it."""
    import json

    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(f"{url}/api/sessions?token={TOKEN}", timeout=10) as r:
            sessions = json.loads(r.read())
        kernels = [s.get("kernel") or {} for s in sessions if str(s.get("path", "")).endswith("quickstart.ipynb")]
        if any(k.get("execution_state") == "idle" and k.get("connections", 0) >= 1 for k in kernels):
            return
        assert time.monotonic() < deadline, f"the notebook's kernel never connected: {sessions}"
        time.sleep(0.2)


def test_quickstart_dashboard_renders_and_changes_in_chromium(jupyter_lab):
    _ensure_chromium()
    sync_playwright = _ensure_playwright()
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"{jupyter_lab}/lab/tree/quickstart.ipynb?token={TOKEN}")
        page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator, .jp-KernelStatus, .jp-Toolbar", timeout=60_000)
        _wait_for_kernel_connected(jupyter_lab)  # not a fixed sleep: the page's kernel is up and attached
        page.click("li.lm-MenuBar-item:has-text('Run')")
        page.click("li.lm-Menu-item:has-text('Run All Cells')")
        # The dashboard appears once the worker is up; then the burst runs for a while.
        kv = page.wait_for_selector(".minivllm-kv img[src^='blob:'], .minivllm-kv img[src^='data:']", timeout=420_000)
        queues = page.wait_for_selector(".minivllm-queues", timeout=60_000)
        kv_sources, queue_texts = set(), set()
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and (len(kv_sources) < 2 or len(queue_texts) < 2 or "running" not in " ".join(queue_texts)):
            kv_sources.add(page.eval_on_selector(".minivllm-kv img", "img => img.src"))
            queue_texts.add(queues.inner_text())
            time.sleep(0.3)
        kv.scroll_into_view_if_needed()
        page.screenshot(path=str(ARTIFACTS / "workbench-quickstart.png"), full_page=False)
        browser.close()
    assert len(kv_sources) >= 2, "the KV page map never changed while requests ran"
    assert len(queue_texts) >= 2 and any("running" in t for t in queue_texts), queue_texts
