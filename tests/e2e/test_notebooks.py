"""Every notebook is committed without outputs, and runs top to bottom on a CPU.

Each notebook names what its outputs must show (`metadata.minivllm.expect`, default: the
chat cell answered "Paris"); `missing_expected_outputs` is that rule's one home.

Running a notebook costs minutes on a small CPU, so each runs once: in JupyterLab under
Chromium (test_browser_notebooks, which also checks these outputs) where that browser
and Playwright are here, otherwise headless through a real Jupyter kernel, below.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from conftest import REPO_ROOT
from test_browser_workbench import CHROMIUM

NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("*.ipynb"))


def missing_expected_outputs(metadata: dict, outputs: list[dict]) -> list[str]:
    """The strings the notebook's metadata expects that none of its outputs contains."""
    text = "\n".join(_output_text(o) for o in outputs)
    return [e for e in metadata.get("minivllm", {}).get("expect", ["Paris"]) if e not in text]


def _output_text(output) -> str:
    data = output.get("data", {})
    text = output.get("text", "")
    return ("".join(text) if isinstance(text, list) else text) + "".join(
        "".join(v) if isinstance(v, list) else v for k, v in data.items() if k in ("text/plain", "text/html"))


def _browser_runs_them() -> bool:
    return os.path.exists(CHROMIUM) and importlib.util.find_spec("playwright") is not None


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_committed_without_outputs(path: Path):
    import nbformat

    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit notebooks without outputs"
    assert not nb.metadata.get("widgets"), "no saved widget state: it carries every widget model and plotly's JS"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes_headless(path: Path, smollm2_path):
    if _browser_runs_them():
        pytest.skip("run once, in JupyterLab under Chromium (test_browser_notebooks checks the same outputs)")
    nbformat = pytest.importorskip("nbformat")
    notebook_client = pytest.importorskip("nbclient").NotebookClient
    nb = nbformat.read(path, as_version=4)
    notebook_client(nb, timeout=600, kernel_name="python3", store_widget_state=False,
                    resources={"metadata": {"path": str(path.parent)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    missing = missing_expected_outputs(nb.metadata, outputs)
    assert not missing, f"{path.name}: {missing} missing from the outputs"
