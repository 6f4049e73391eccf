"""Smoke tests of the continuous-batching, scheduling, prefix-cache, speculative and other benchmark
drivers (tiny sizes, no timing checks)."""

from __future__ import annotations

import json

import pytest
from conftest import PROVENANCE_KEYS  # the results_dir fixture is in conftest too


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

    out = run(str(smollm2_path), concurrency=[1, 2], max_tokens=4, decode_lengths=[6], repeats=1, max_repeats=1,
              prompts=["Hello", "The sky is"])
    data = _load(results_dir, "continuous-batching-")
    assert [r["concurrency"] for r in data["rows"]] == [1, 2]
    settings = data["provenance"]["settings"]
    assert settings["max_tokens"] == 4
    # one round asked for, at most one allowed: exactly one run per row, recorded with its CVs
    assert settings["repeats"] == 1 and settings["max_repeats"] == 1 and settings["cv_target"] == 0.05
    assert [(r["concurrency"], r["runs"], r["max_runs"], r["stopped"]) for r in settings["rounds"]] == \
        [(1, 1, 1, "stable"), (2, 1, 1, "stable")]
    for r in data["rows"]:
        assert r["batched_tok_s_mean"] > 0 and r["sequential_tok_s_mean"] > 0 and r["batched/sequential_mean"] > 0
        assert r["runs"] == 1 and len(r["samples"]["batched_tok_s"]) == 1 and r["stopped"] == "stable"
        assert r["batched_tok_s_cv"] == r["sequential_tok_s_cv"] == r["cv"] == 0
    md = sorted(results_dir.glob("continuous-batching-*.md"))[0].read_text()
    assert "mean ± sample std over 1 runs (at least 1, more while the CV" in md and "| runs | cv |" in md
    kv = _load(results_dir, "paged-vs-contiguous-")
    assert [r["decode_tokens"] for r in kv["rows"]] == [6]
    assert kv["rows"][0]["paged_decode_tok_s_mean"] > 0 and kv["rows"][0]["contiguous_decode_tok_s_mean"] > 0
    assert kv["rows"][0]["runs"] == 1 and len(kv["rows"][0]["samples"]["paged"]) == 1
    assert kv["rows"][0]["paged_decode_tok_s_cv"] == kv["rows"][0]["contiguous_decode_tok_s_cv"] == 0
    assert [(r["decode_tokens"], r["runs"], r["stopped"]) for r in kv["provenance"]["settings"]["rounds"]] == \
        [(6, 1, "stable")]
    assert len(out["batching"]) == 2 and len(out["kv"]) == 1


@pytest.mark.parametrize("driver", ["continuous_batching", "gemv_threshold", "scheduling", "prefix_cache"])
def test_max_repeats_below_repeats_is_refused(driver):
    import importlib

    from minivllm.errors import ConfigError

    with pytest.raises(ConfigError, match="max_repeats"):  # refused before the model is loaded
        importlib.import_module(f"minivllm.bench.{driver}").run("smollm2-135m", repeats=3, max_repeats=2)


def test_speculative_max_runs_below_runs_is_refused():
    from minivllm.bench.speculative import run
    from minivllm.errors import ConfigError

    with pytest.raises(ConfigError, match="max_runs"):  # refused before the models are loaded
        run("no-such-target", "no-such-draft", runs=3, max_runs=2)


def test_prefix_cache_driver(results_dir, tmp_path, monkeypatch):
    """Two of the tables (a two-case row and one-case rows) on a tiny model with short paragraphs:
    one run asked for, at most one allowed, so exactly one run per case, recorded per row and in
    the settings."""
    from synthetic_gguf import write_tiny_model

    from minivllm.bench import prefix_cache

    model = write_tiny_model(tmp_path / "tiny.gguf", n_layers=1, d_model=64, d_ff=128, n_heads=4, n_kv_heads=2,
                             vocab_size=512, context_length=4096)
    monkeypatch.setattr(prefix_cache, "paragraph", lambda namespace, i: f"{namespace} paragraph {i}.")
    tables = prefix_cache.run(str(model), repeats=1, max_repeats=1, output_tokens=2,
                              parts=["incremental", "single-flight"], groups=(2,))
    data = _load(results_dir, "prefix-cache-")
    settings = data["provenance"]["settings"]
    assert settings["repeats"] == 1 and settings["max_repeats"] == 1 and settings["cv_target"] == 0.05
    assert [(r["table"], r["case"], r["runs"], r["max_runs"], r["stopped"]) for r in settings["rounds"]] == [
        ("incremental", "at_completion", 1, 1, "stable"), ("incremental", "incremental", 1, 1, "stable"),
        ("single-flight", "independent", 1, 1, "stable"), ("single-flight", "at_completion", 1, 1, "stable"),
        ("single-flight", "after_prefill", 1, 1, "stable")]
    assert settings["rounds"][0]["watched"] == ["mean_ttft_s", "followers_mean_ttft_s"]
    assert all(len(r["cvs"]) == 2 for r in settings["rounds"])
    (inc,) = tables["incremental"]
    assert inc["at_completion_runs"] == inc["incremental_runs"] == 1 and inc["stopped"] == "stable"
    assert inc["incremental_mean_ttft_s_cv"] == inc["incremental_followers_ttft_s_cv"] == inc["cv"] == 0
    assert len(inc["incremental_samples"]) == 1
    assert inc["incremental_restored_per_follower"] and inc["incremental_restored_per_follower"][0] > 0
    flight = tables["single-flight"]
    assert [r["release"] for r in flight] == ["independent", "at_completion", "after_prefill"]
    for r in flight:
        assert r["runs"] == 1 and len(r["samples"]) == 1 and r["stopped"] == "stable"
        assert r["mean_ttft_s_cv"] == r["slowest_completion_s_cv"] == r["cv"] == 0
    md = sorted(results_dir.glob("prefix-cache-*.md"))[0].read_text()
    assert "mean ± sample std over 1 runs (at least 1, more while the CV" in md and "| Runs |" in md
    assert "| 1/1 |" in md and "| 1/1/1 |" in md


def test_scheduling_driver(results_dir, smollm2_path):
    from minivllm.bench.scheduling import run

    run(str(smollm2_path), repeats=1, max_repeats=1, long_prompts=2, long_tokens=24, short_tokens=4,
        fair_prompts=2, fair_tokens=24, max_batched_tokens=8, max_tokens=2)
    policies = ["fcfs", "shortest-prefill-first", "round-robin"]
    hol = _load(results_dir, "scheduling-head-of-line-")
    assert [r["policy"] for r in hol["rows"]] == policies
    # one round asked for, at most one allowed: exactly one run per workload, recorded with its CVs
    rounds = hol["provenance"]["settings"]["rounds"]
    assert hol["provenance"]["settings"]["max_repeats"] == 1
    assert {name: (r["runs"], r["max_runs"], r["stopped"]) for name, r in rounds.items()} == \
        {"head_of_line": (1, 1, "stable"), "fairness": (1, 1, "stable")}
    assert rounds["head_of_line"]["watched"][:2] == ["fcfs short_ttft_s", "fcfs long_ttft_mean_s"]
    assert len(rounds["head_of_line"]["cvs"]) == 2 * len(policies) == len(rounds["fairness"]["cvs"])
    for r in hol["rows"]:
        assert r["runs"] == 1 and len(r["samples"]["ttft"]) == 1 and r["stopped"] == "stable"
        assert r["short_ttft_s_cv"] == r["long_ttft_mean_s_cv"] == r["cv"] == 0
    fcfs = hol["rows"][0]
    assert fcfs["short_ttft_vs_fcfs_mean"] == pytest.approx(1.0)
    # Chunked prefill with a budget of 8: the short prompt waits for both long ones under fcfs only.
    spf = hol["rows"][1]
    assert spf["short_ttft_s_mean"] > 0 and fcfs["short_ttft_s_mean"] > 0
    fair = _load(results_dir, "scheduling-fairness-")
    assert [r["policy"] for r in fair["rows"]] == policies
    assert all(r["spread_s_mean"] >= 0 for r in fair["rows"])
    assert fair["provenance"]["settings"]["max_batched_tokens"] == 8
    for r in fair["rows"]:
        assert r["runs"] == 1 and r["oldest_ttft_s_cv"] == r["later_mean_ttft_s_cv"] == r["cv"] == 0
    md = sorted(results_dir.glob("scheduling-fairness-*.md"))[0].read_text()
    assert "mean ± sample std over 1 runs (at least 1, more while the CV" in md and "| runs | cv |" in md


# --- gemv-threshold and decode (issue 4) ------------------------------------------------


def _matmuls_per_forward(path) -> int:
    """q, k, v, o, gate, up, down per layer, plus the LM head."""
    from minivllm.gguf.reader import GGUFFile

    with GGUFFile(path) as gf:
        return 7 * int(gf.require(f"{gf.architecture}.block_count")) + 1


def test_gemv_threshold_driver(results_dir, smollm2_path):
    from minivllm.bench.gemv_threshold import run

    max_tokens = 2
    rows = run(str(smollm2_path), concurrency=[1, 2], max_tokens=max_tokens, repeats=1, batch_invariant=True,
               prompts=["Hello there, how", "The sky is blue and"])
    data = _load(results_dir, "gemv-threshold-")
    assert [r["concurrency"] for r in data["rows"]] == [1, 2]
    # one round asked for: no spread to see, so no extra rounds (max_repeats defaults to 3 x repeats)
    settings = data["provenance"]["settings"]
    assert settings["max_repeats"] == 3 and settings["cv_target"] == 0.05
    assert [(r["concurrency"], r["runs"], r["max_runs"], r["stopped"]) for r in settings["rounds"]] == \
        [(1, 1, 3, "stable"), (2, 1, 3, "stable")]
    assert all(len(r["cvs"]) == 4 for r in settings["rounds"])  # one per mode
    for r in data["rows"]:
        assert r["runs"] == 1 and r["cv"] == 0 and r["stopped"] == "stable"
        for key in ("sequential_tok_s", "gemm_tok_s", "gemv_tok_s", "batch_invariant_tok_s"):
            assert r[f"{key}_mean"] > 0 and r[f"{key}_median"] > 0
            assert r[f"{key}_cv"] == 0 and len(r["samples"][key.removesuffix("_tok_s")]) == 1
        assert r["gemv/gemm_median"] == pytest.approx(r["gemv_tok_s_median"] / r["gemm_tok_s_median"])
    # Each mode ran the kernel it is named after: every matmul of the GEMM mode took GEMM; in
    # the GEMV mode (N=2 <= gemv_max_rows) every decode step's matmuls took GEMV, and in the
    # prefill step (more rows than that) the layers took GEMM while the LM head, which sees
    # only the N last rows, took GEMV; batch-invariant mode used only the invariant kernel.
    per_forward = _matmuls_per_forward(smollm2_path)
    paths = rows[1]["matmul_paths_per_run"]
    assert paths["gemm"] == {"gemm": max_tokens * per_forward}
    assert paths["gemv"] == {"gemm": per_forward - 1, "gemv": (max_tokens - 1) * per_forward + 1}
    assert paths["batch_invariant"] == {"gemv-invariant": max_tokens * per_forward}
    expected = max([r["concurrency"] for r in rows if r["gemv/gemm_median"] >= 1], default=0)
    assert data["provenance"]["recommended_gemv_max_rows"] == expected


def test_gemv_threshold_recommendation():
    from minivllm.bench.gemv_threshold import recommend

    rows = [{"concurrency": n, "gemv/gemm_median": r} for n, r in [(1, 1.3), (2, 1.1), (3, 1.0), (4, 0.9), (5, 0.8)]]
    assert recommend(rows) == 3
    assert recommend([{"concurrency": 1, "gemv/gemm_median": 0.7}]) == 0


LLAMA_CPP_SITE = next(iter(sorted(__import__("glob").glob("/tmp/lcpp/lib/python3*/site-packages"))), None)


def test_decode_driver_with_baselines(results_dir, smollm2_path):
    from minivllm.bench.decode import run

    rows = run(str(smollm2_path), ["cpu"], ["f32"], max_tokens=3, prompt_tokens=24, repeats=1, threads=2,
               llama_cpp_path=LLAMA_CPP_SITE)
    data = _load(results_dir, "decode-")
    # llama.cpp runs between the two when installed; a skipped row comes last
    by_engine = {r["engine"]: r for r in data["rows"]}
    assert sorted(by_engine) == ["llama.cpp", "minivllm", "transformers"] and data["rows"][0]["engine"] == "minivllm"
    ours, llama, hf = by_engine["minivllm"], by_engine["llama.cpp"], by_engine["transformers"]
    assert data["provenance"]["settings"]["threads"] == 2 and data["provenance"]["settings"]["prompt_tokens"] == 24
    # one round asked for: no spread to see, so no extra rounds (max_repeats defaults to 3 x repeats)
    assert data["provenance"]["settings"]["rounds"]["runs"] == 1 and data["provenance"]["settings"]["max_repeats"] == 3
    assert ours["runs"] == 1 and ours["decode_tok_s_cv"] == 0
    assert ours["cached_prompt_tokens"] == 0  # after the warm-up, the prefill still computes every prompt token
    for r in (ours, hf):
        assert r["status"] == "ok" and r["prompt_tokens"] == 24 and r["decode_tokens"] == 3
        assert r["prefill_tok_s_median"] > 0 and r["decode_tok_s_median"] > 0
    # transformers runs the same file in float32: the same greedy tokens.
    assert hf["same_tokens_as_first_row"] == 3
    assert hf["minivllm/this_decode"] == pytest.approx(ours["decode_tok_s_median"] / hf["decode_tok_s_median"])
    from minivllm.bench.decode import load_llama_cpp

    if load_llama_cpp(LLAMA_CPP_SITE)[0] is None:  # neither in this environment nor at /tmp/lcpp
        assert llama["status"].startswith("not installed")
    else:
        assert llama["status"] == "ok" and llama["decode_tok_s_median"] > 0
        assert llama["minivllm/this_prefill"] == pytest.approx(
            ours["prefill_tok_s_median"] / llama["prefill_tok_s_median"]
        )
    assert len(rows) == 3


def test_decode_prompt_is_cut_from_the_prompt_file(smollm2_path):
    import json

    from minivllm.bench.decode import PROMPTS_FILE, long_prompt_ids
    from minivllm.gguf.reader import GGUFFile
    from minivllm.gguf.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(GGUFFile(smollm2_path))
    ids = long_prompt_ids(tok, 512)
    assert len(ids) == 512
    first = json.loads(PROMPTS_FILE.read_text())["prompts"][0]
    assert tok.decode(ids).startswith(first)


def test_decode_llama_cpp_missing_is_reported(monkeypatch, tmp_path):
    import sys

    from minivllm.bench.decode import LLAMA_CPP_ENV, load_llama_cpp

    monkeypatch.delenv(LLAMA_CPP_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # how Python marks a module as unimportable
    module, why = load_llama_cpp(None)
    assert module is None and why.startswith("not installed") and LLAMA_CPP_ENV in why
    module, why = load_llama_cpp(str(tmp_path / "nowhere"))
    assert module is None and "nowhere" in why


def test_decode_synthetic_model_is_refused_on_cpu(results_dir, tmp_path, monkeypatch):
    from minivllm.bench.decode import run
    from minivllm.errors import ConfigError

    # Should the refusal break, fail fast instead of writing 4.7 GB into the real cache.
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))
    monkeypatch.setenv("MINIVLLM_OFFLINE", "1")

    with pytest.raises(ConfigError, match="GPU"):
        run(devices=["cpu"], synthetic="qwen2.5-7b-q4_k_m")


def test_speculative_driver(results_dir, tmp_path):
    """Tiny target + a differently seeded tiny draft (same vocabulary): every table and case
    runs, rows carry acceptance and ratios, and the texts are saved with the numbers."""
    from synthetic_gguf import write_tiny_model

    from minivllm.bench.speculative import run

    target = write_tiny_model(tmp_path / "target.gguf", n_layers=2, d_model=64, d_ff=128, n_heads=4, n_kv_heads=2,
                              vocab_size=512, context_length=4096, seed=1)
    draft = write_tiny_model(tmp_path / "draft.gguf", n_layers=1, d_model=64, d_ff=128, n_heads=4, n_kv_heads=2,
                             vocab_size=512, context_length=4096, seed=2)
    tables = run(str(target), str(draft), max_tokens=6, runs=1, max_runs=1, seeds=2, tv_budgets=(0.0, 1.0),
                 prompts=["code"], engine_options={"gemv_max_rows": 0})
    data = _load(results_dir, "speculative-")
    # one run asked for, at most one allowed: exactly one run per case (one generation per seed), recorded
    settings = data["provenance"]["settings"]
    assert settings["runs"] == 1 and settings["max_runs"] == 1 and settings["cv_target"] == 0.05
    assert len(settings["rounds"]) == len(data["rows"])
    assert all((r["runs"], r["max_runs"], r["stopped"]) == (1, 1, "stable") for r in settings["rounds"])
    assert settings["rounds"][0]["watched"] == ["e2e_s"]  # greedy: no seed
    assert settings["rounds"][-1]["watched"] == ["e2e_s_seed0", "e2e_s_seed1"]  # sampling: one series per seed
    for r in data["rows"]:
        assert r["runs"] == 1 and r["cv"] == 0 and r["stopped"] == "stable"
        assert r["n"] == (1 if r["table"] == "greedy" else 2)
        assert (r["e2e_s_cv"] == 0) if r["table"] == "greedy" else (r["e2e_s_seed0_cv"] == r["e2e_s_seed1_cv"] == 0)
    assert {r["table"] for r in data["rows"]} == {"greedy", "sampling"}  # sampling on the one prompt given
    greedy = [r for r in tables["greedy"] if r["prompt"] == "code"]
    assert [r["case"] for r in greedy] == ["target-only", "fixed-4", "fixed-6", "fixed-8", "acceptance-rate",
                                           "accepted-length", "adaptive", "draft-only"]
    assert greedy[0]["speedup_e2e"] == 1.0 and greedy[0]["acceptance"] is None
    assert greedy[1]["proposed"] > 0 and greedy[1]["rounds_per_request"] > 0
    sampling = tables["sampling"]
    tv1 = next(r for r in sampling if r["case"] == "fixed:8 TV=1")
    assert tv1["acceptance"] == 1.0 and tv1["n"] == 2  # a TV budget of 1 accepts every draft token
    assert (
        all(r["texts"] for r in sampling)
        and "## Generated texts" in next(results_dir.glob("speculative-*.md")).read_text()
    )
