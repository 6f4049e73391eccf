"""The Kaggle notebook top to bottom, its install cell included, in a fresh venv that holds only
what Kaggle's image brings for it: torch (the CPU build here), ipywidgets 8.1.5 and a Jupyter
kernel (ipykernel). `python -m venv` without `--system-site-packages`, so nothing of this venv
(minivllm's editable install, transformers, pytest, plotly) can be seen from the kernel; a first
cell added by the test checks that from inside before the install cell runs. The install cell
then installs the freshly built wheel named by MINIVLLM_WHEEL and its missing requirements from
the package index, as it would on Kaggle.

The venv is built anew for every run (about 25 s: torch comes from the same place `make setup`
takes it, scripts/install_torch.sh; the rest from pip's cache once warm), so no state of an
earlier run can leak in; the CPU kernels are compiled for it too. The notebook runs from a folder
outside the repository. About 2 minutes on an idle two-core machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT
from wheel_build import build_wheel

nbformat = pytest.importorskip("nbformat")
NotebookClient = pytest.importorskip("nbclient").NotebookClient
jupyter_client = pytest.importorskip("jupyter_client")

NOTEBOOK = REPO_ROOT / "notebooks" / "kaggle_2xT4.ipynb"
# What Kaggle's image has that the notebook relies on; torch comes from scripts/install_torch.sh.
KAGGLE_PACKAGES = ("ipywidgets==8.1.5", "ipykernel")
# `pip list --not-required` of the fresh venv: these and their dependencies, nothing else.
TOP_LEVEL = {"torch", "ipywidgets", "ipykernel", "pip", "setuptools"}
# Must NOT import in the kernel before the install cell: minivllm itself, and what only the dev
# venv has (proof that the kernel cannot see it).
ABSENT_BEFORE = ("minivllm", "minivllm_widgets", "transformers", "pytest", "plotly", "gguf", "llguidance")
MARK = "FRESH-VENV-CHECK "

CHECK_BEFORE = f"""
import importlib.metadata as md, importlib.util, json, sys
print({MARK!r} + json.dumps({{"prefix": sys.prefix, "base_prefix": sys.base_prefix, "path": sys.path,
    "importable": [m for m in {ABSENT_BEFORE!r} if importlib.util.find_spec(m) is not None],
    "dists": sorted(d.metadata["Name"].lower() for d in md.distributions())}}))
"""
# Also asks the install cell's own pip_install (dry run) for a newer ipywidgets: its constraints
# must make pip refuse, where a plain `pip install` would replace Kaggle's build.
CHECK_AFTER = f"""
import importlib.metadata as md, json, subprocess, minivllm, minivllm_widgets, torch
try:
    pip_install("--dry-run", "ipywidgets>8.1.5")
    refused = False
except subprocess.CalledProcessError:
    refused = True
print({MARK!r} + json.dumps({{"minivllm": minivllm.__file__, "widgets": minivllm_widgets.__file__,
    "torch": md.version("torch"), "ipywidgets": md.version("ipywidgets"), "newer_ipywidgets_refused": refused,
    "dists": sorted(d.metadata["Name"].lower() for d in md.distributions())}}))
"""


def _pip(py: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(py), "-m", "pip", *args], capture_output=True, text=True, timeout=timeout)


def _kaggle_like_venv(venv: Path) -> Path:
    """A venv with torch, ipywidgets 8.1.5 and ipykernel (with their dependencies) only."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    probe = _pip(py, "download", "--no-deps", "-q", "-d", str(venv / "probe"), KAGGLE_PACKAGES[0], timeout=300)
    if probe.returncode != 0:
        pytest.skip(f"the package index cannot be reached for {KAGGLE_PACKAGES[0]}: "
                    f"{(probe.stderr.strip().splitlines() or ['?'])[-1]}")
    torch = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "install_torch.sh"), str(py)],
                           capture_output=True, text=True, timeout=900)
    assert torch.returncode == 0, torch.stdout[-2000:] + torch.stderr[-2000:]
    kaggle = _pip(py, "install", "-q", *KAGGLE_PACKAGES)
    assert kaggle.returncode == 0, kaggle.stderr[-3000:]
    return py


def _output_text(output) -> str:
    data = output.get("data", {})
    return output.get("text", "") + data.get("text/plain", "") + data.get("text/html", "")


def _cell_json(cell) -> dict:
    text = "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")
    line = next((x for x in text.splitlines() if x.startswith(MARK)), None)
    assert line is not None, f"check cell printed no result: {cell.get('outputs')}"
    return json.loads(line[len(MARK):])


def test_kaggle_notebook_runs_in_a_fresh_venv_with_only_torch_and_ipywidgets(tmp_path, smollm2_path):
    import minivllm

    wheel = build_wheel(tmp_path)
    venv = tmp_path / "kaggle-venv"
    py = _kaggle_like_venv(venv)
    top = json.loads(_pip(py, "list", "--not-required", "--format", "json").stdout)
    assert {d["name"].lower() for d in top} <= TOP_LEVEL, top

    # A kernel spec for the fresh venv's own python; nbclient here drives it over ZMQ.
    spec_dir = tmp_path / "kernels" / "kaggle-fresh"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [str(py), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "fresh Kaggle-like venv", "language": "python"}))
    km = jupyter_client.AsyncKernelManager(
        kernel_name="kaggle-fresh",
        kernel_spec_manager=jupyter_client.kernelspec.KernelSpecManager(kernel_dirs=[str(spec_dir.parent)]))
    # The kernel's environment: this one's, less whatever points into the dev venv or the
    # checkout, and not on Kaggle (the install cell must install because MINIVLLM_WHEEL is set).
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "KAGGLE_KERNEL_RUN_TYPE", "MINIVLLM_GIT_URL")}
    env.update(MINIVLLM_WHEEL=str(wheel), PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
               # The CPU kernels are built for this venv's torch, as on a first run on Kaggle (~40 s on
               # two cores), into this test's folder rather than a new entry in ~/.cache on every run.
               TORCH_EXTENSIONS_DIR=str(tmp_path / "torch_extensions"))

    nb = nbformat.read(NOTEBOOK, as_version=4)
    install = next(i for i, c in enumerate(nb.cells) if "def minivllm_source" in c.source)
    nb.cells.insert(install, nbformat.v4.new_code_cell(CHECK_BEFORE))
    nb.cells.append(nbformat.v4.new_code_cell(CHECK_AFTER))
    workdir = tmp_path / "run"   # outside the repository: nothing can come from the source tree
    workdir.mkdir()
    NotebookClient(nb, km=km, timeout=600, store_widget_state=False,
                   resources={"metadata": {"path": str(workdir)}}).execute(env=env, cleanup_kc=True)  # then shut down

    before = _cell_json(nb.cells[install])
    assert Path(before["prefix"]) == venv and before["base_prefix"] != before["prefix"], before
    assert before["importable"] == [], before
    for entry in before["path"]:   # the venv, the interpreter's standard library, the working folder
        assert not entry or entry.startswith((str(venv), before["base_prefix"], str(workdir))), entry
        assert "site-packages" not in entry or entry.startswith(str(venv)), entry
    assert "minivllm" not in before["dists"] and {"torch", "ipywidgets", "ipykernel"} <= set(before["dists"])

    text = "\n".join(_output_text(o) for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert f"minivllm {minivllm.__version__} from {wheel}" in text, text[:3000]
    for expected in nb.metadata.get("minivllm", {}).get("expect", []):
        assert expected in text, f"{expected!r} missing from the outputs"

    after = _cell_json(nb.cells[-1])
    site = str(venv / "lib")
    assert after["minivllm"].startswith(site) and after["widgets"].startswith(site), after
    torch_before = next(d["version"] for d in top if d["name"].lower() == "torch")
    assert after["torch"] == torch_before and after["ipywidgets"] == "8.1.5", after
    assert after["newer_ipywidgets_refused"], after
    # The install cell only added: minivllm, its requirements and the widgets extra; every
    # distribution the venv had is still there (torch's and ipywidgets' versions checked above).
    assert set(before["dists"]) <= set(after["dists"]), set(before["dists"]) - set(after["dists"])
    assert {"minivllm", "gguf", "llguidance", "plotly"} <= set(after["dists"]), after["dists"]
