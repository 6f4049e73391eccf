"""Every notebook runs top to bottom on a CPU, headless, through a real Jupyter kernel."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REPO_ROOT

nbformat = pytest.importorskip("nbformat")
NotebookClient = pytest.importorskip("nbclient").NotebookClient

NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path: Path, smollm2_path):
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit notebooks without outputs"
    # No saved widget state: it would carry every widget model (and plotly's JS) into the file.
    NotebookClient(nb, timeout=600, kernel_name="python3", store_widget_state=False,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    text = "\n".join(_output_text(o) for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    # Each notebook names what its outputs must show (default: the chat cell answered "Paris").
    for expected in nb.metadata.get("minivllm", {}).get("expect", ["Paris"]):
        assert expected in text, f"{path.name}: {expected!r} missing from the outputs"


def _output_text(output) -> str:
    data = output.get("data", {})
    return output.get("text", "") + data.get("text/plain", "") + data.get("text/html", "")
