"""`minivllm bench routing --quick` and `minivllm smoke` end to end on smollm2 with two
one-thread CPU workers (real worker processes; tiny sizes, no timing checks)."""

from __future__ import annotations

import json

import pytest

import minivllm.bench.results as results
from minivllm.bench.routing import percentile
from minivllm.cli.main import main


@pytest.fixture
def results_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "RESULTS_DIR", tmp_path)
    return tmp_path


def test_bench_routing_quick(results_dir, smollm2_path, capsys):
    assert main(["bench", "routing", "--quick", "--max-runs", "1", "--model", str(smollm2_path),
                 "--inference-device", "cpu:1", "--inference-device", "cpu:1"]) == 0
    files = sorted(results_dir.glob("routing-*.json"))
    assert len(files) == 1 and files[0].with_name(files[0].name[:-5] + ".md").exists()
    data = json.loads(files[0].read_text())
    meta = data["provenance"]
    assert len(meta["model_sha256"]) == 64 and meta["commit"]
    settings = meta["settings"]
    assert settings["bursts"] == [4] and settings["runs"] == 1 and settings["max_tokens"] == 8
    assert settings["prompt_tokens"] == 64 and settings["prefix_tokens"] == 48
    # one run asked for, at most one allowed: exactly one run per (policy, burst), recorded with its CV
    assert settings["max_runs"] == 1 and settings["cv_target"] == 0.05
    assert [
        (r["burst"], r["policy"], r["runs"], r["max_runs"], r["stopped"], r["watched"]) for r in settings["rounds"]
    ] == [(4, p, 1, 1, "stable", ["completion_s"]) for p in ("forced-fastest", "round-robin", "cost")]
    assert [w["name"] for w in meta["workers"]] == ["cpu", "cpu#2"]
    fastest = meta["forced_fastest"]["worker"]
    assert fastest in ("cpu", "cpu#2")

    rows = {r["policy"]: r for r in data["rows"]}
    assert set(rows) == {"forced-fastest", "round-robin", "cost"}
    assert rows["forced-fastest"]["router"] == f"forced:{fastest}"
    for row in rows.values():
        assert row["burst"] == 4 and len(row["runs"]) == 1
        assert row["runs_n"] == 1 and row["completion_s_cv"] == row["cv"] == 0 and row["stopped"] == "stable"
        assert row["completion_s_mean"] > 0 and row["output_tok_s_mean"] > 0
        for run in row["runs"]:
            assert sum(run["requests_per_worker"].values()) == 4
            assert run["completion_s"] > 0 and run["output_tokens"] == 4 * 8
            assert run["ttft_p50_s"] <= run["ttft_p95_s"] <= run["e2e_p95_s"]
            # The seeded prefix (3 pages of 16) is restored for every request; the unique tail is not.
            assert [q["cached_prompt_tokens"] for q in run["requests"]] == [48] * 4
            assert all(q["prompt_tokens"] == 64 and q["output_tokens"] == 8 for q in run["requests"])
    assert rows["forced-fastest"]["runs"][0]["requests_per_worker"][fastest] == 4
    assert rows["round-robin"]["runs"][0]["requests_per_worker"] == {"cpu": 2, "cpu#2": 2}
    assert rows["forced-fastest"]["throughput_vs_forced_fastest"] == pytest.approx(1.0)
    decisions = rows["cost"]["runs"][0]["decisions"]
    assert len(decisions) == 4 and all(d["policy"] == "cost" for d in decisions)
    assert all(c["cached_tokens"] == 48 for d in decisions for c in d["candidates"])
    out = capsys.readouterr().out
    assert "## Burst of 4" in out and "| cost |" in out and "Cost router decisions" in out
    assert "mean ± sample std over 1 runs (at least 1, more while the CV of a case's completion time" in out


def test_bench_routing_max_runs_below_runs_is_refused():
    from minivllm.bench.routing import run
    from minivllm.errors import ConfigError

    with pytest.raises(ConfigError, match="max_runs"):  # refused before any worker starts
        run("smollm2-135m", runs=3, max_runs=2)


def test_smoke_one_cpu_worker(smollm2_path, capsys):
    from minivllm.bench.drivers.smoke import default_prompt
    from minivllm.gguf.tokenizer import Tokenizer

    assert main(["smoke", "--model", str(smollm2_path), "--inference-device", "cpu:1", "--max-tokens", "8"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert lines[0] == "| Backend | Input tokens | Output tokens | Prefill tok/s | Decode tok/s |"
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert len(rows) == 1
    backend, input_tokens, output_tokens, prefill, decode = rows[0]
    assert backend == "CPU (1 thread)"
    expected = len(Tokenizer.from_gguf(smollm2_path).encode(default_prompt()))
    assert int(input_tokens.replace(",", "")) == expected and int(output_tokens) == 8
    assert float(prefill.replace(",", "")) > 0 and float(decode.replace(",", "")) > 0


def test_percentile():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 95) == pytest.approx(1.95)
    assert percentile([5.0], 95) == 5.0
