"""Smoke tests of the continuous-batching and scheduling benchmark drivers (tiny sizes, no timing checks)."""

from __future__ import annotations

import json

import pytest

import minivllm.bench.results as results

PROVENANCE_KEYS = {"commit", "date", "device", "host", "python", "torch", "cuda", "gguf", "tokenizers",
                   "model_sha256", "settings"}


@pytest.fixture
def results_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "RESULTS_DIR", tmp_path)
    return tmp_path


def _load(results_dir, prefix: str) -> dict:
    files = sorted(results_dir.glob(f"{prefix}*.json"))
    assert len(files) == 1, files
    assert files[0].with_name(files[0].name[:-5] + ".md").exists()
    data = json.loads(files[0].read_text())
    assert PROVENANCE_KEYS <= set(data["provenance"])
    assert len(data["provenance"]["model_sha256"]) == 64
    return data


def test_continuous_batching_driver(results_dir, smollm2_path):
    from minivllm.bench.continuous_batching import run

    out = run(str(smollm2_path), concurrency=[1, 2], max_tokens=4, decode_lengths=[6], repeats=1,
              prompts=["Hello", "The sky is"])
    data = _load(results_dir, "continuous-batching-")
    assert [r["concurrency"] for r in data["rows"]] == [1, 2]
    assert data["provenance"]["settings"]["max_tokens"] == 4
    for r in data["rows"]:
        assert r["batched_tok_s_mean"] > 0 and r["sequential_tok_s_mean"] > 0 and r["batched/sequential_mean"] > 0
    kv = _load(results_dir, "paged-vs-contiguous-")
    assert [r["decode_tokens"] for r in kv["rows"]] == [6]
    assert kv["rows"][0]["paged_decode_tok_s_mean"] > 0 and kv["rows"][0]["contiguous_decode_tok_s_mean"] > 0
    assert len(out["batching"]) == 2 and len(out["kv"]) == 1


def test_scheduling_driver(results_dir, smollm2_path):
    from minivllm.bench.scheduling import run

    run(str(smollm2_path), repeats=1, long_prompts=2, long_tokens=24, short_tokens=4, fair_prompts=2,
        fair_tokens=24, max_batched_tokens=8, max_tokens=2)
    policies = ["fcfs", "shortest-prefill-first", "round-robin"]
    hol = _load(results_dir, "scheduling-head-of-line-")
    assert [r["policy"] for r in hol["rows"]] == policies
    fcfs = hol["rows"][0]
    assert fcfs["short_ttft_vs_fcfs_mean"] == pytest.approx(1.0)
    # Chunked prefill with a budget of 8: the short prompt waits for both long ones under fcfs only.
    spf = hol["rows"][1]
    assert spf["short_ttft_s_mean"] > 0 and fcfs["short_ttft_s_mean"] > 0
    fair = _load(results_dir, "scheduling-fairness-")
    assert [r["policy"] for r in fair["rows"]] == policies
    assert all(r["spread_s_mean"] >= 0 for r in fair["rows"])
    assert fair["provenance"]["settings"]["max_batched_tokens"] == 8
