"""The wheel a Kaggle user attaches: built as `make wheel` builds it, installed with `--no-deps`
into a fresh venv that already has torch (this venv's, as Kaggle has its own CUDA build) by the
Kaggle notebook's own install cell (run as on Kaggle), then imported and run from outside the
repository, so nothing can come from the source tree.

The fresh venv sees this venv's site-packages through a `.pth` line: torch and the other
dependencies are found there without a download, while `.pth` files inside that folder (the
editable install's import hook) are not processed, so `minivllm` can only come from the wheel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

from conftest import REPO_ROOT
from wheel_build import build_wheel


def test_wheel_installs_with_no_deps_over_existing_torch_and_generates(tmp_path, smollm2_path):
    import minivllm

    wheel = build_wheel(tmp_path)
    assert wheel.name == f"minivllm-{minivllm.__version__}-py3-none-any.whl"
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"minivllm/__init__.py", "minivllm_widgets/__init__.py", "minivllm_widgets/workbench.py",
            "minivllm/kernels/cpu_gemv.cpp"} <= names
    assert not any(n.startswith(("tests/", "notebooks/", "widgets/")) for n in names)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)  # pip from ensurepip, offline
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "existing-torch.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # The notebook's install cell in a fresh venv off Kaggle (no KAGGLE_KERNEL_RUN_TYPE), the wheel
    # named by MINIVLLM_WHEEL: a named source is installed anywhere, as on Kaggle.
    nb = json.loads((REPO_ROOT / "notebooks" / "kaggle_2xT4.ipynb").read_text())
    cell = next("".join(c["source"]) for c in nb["cells"] if "def minivllm_source" in "".join(c["source"]))
    env = {**{k: v for k, v in os.environ.items() if k != "KAGGLE_KERNEL_RUN_TYPE"}, "MINIVLLM_WHEEL": str(wheel),
           "PIP_NO_INDEX": "1", "PYTHONPATH": ""}
    done = subprocess.run([str(py), "-c", cell], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert f"minivllm {minivllm.__version__} from {wheel}" in done.stdout, done.stdout
    assert "missing requirements installed: none" in done.stdout and "kept untouched: torch" in done.stdout, done.stdout

    script = textwrap.dedent(f"""
        import json, torch, minivllm, minivllm_widgets
        from minivllm import LLM, SamplingParams
        from minivllm_widgets import Workbench, DivergenceExplorer
        llm = LLM({str(smollm2_path)!r}, device="cpu", progress=False, max_model_len=128)
        out = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8))[0]
        print(json.dumps({{"minivllm": minivllm.__file__, "widgets": minivllm_widgets.__file__,
                          "torch": torch.__file__, "tokens": len(out.token_ids), "text": out.text}}))
    """)
    # PYTHONPATH emptied here too: a checkout on it would shadow the wheel.
    done = subprocess.run([str(py), "-c", script], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["minivllm"].startswith(str(site)) and got["widgets"].startswith(str(site)), got
    assert got["torch"].startswith(sysconfig.get_paths()["purelib"]), got  # the existing torch, not a new one
    assert got["tokens"] == 8 and got["text"].strip(), got
