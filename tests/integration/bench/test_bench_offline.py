"""`minivllm bench offline`: the workload generator, the exact-length check and the driver at tiny sizes."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from conftest import PROVENANCE_KEYS  # the results_dir fixture is in conftest too


def test_workload_is_seeded_in_range_and_free_of_special_tokens():
    import numpy as np

    from minivllm.bench.offline import make_workload

    allowed = np.array([5, 7, 11, 13])
    a = make_workload(allowed, 20, (3, 9), (2, 4), seed=1)
    assert a == make_workload(allowed, 20, (3, 9), (2, 4), seed=1)
    assert a != make_workload(allowed, 20, (3, 9), (2, 4), seed=2)
    prompts, out_lens = a
    assert len(prompts) == len(out_lens) == 20
    assert all(3 <= len(p) <= 9 for p in prompts) and all(2 <= n <= 4 for n in out_lens)
    assert {t for p in prompts for t in p} <= {5, 7, 11, 13}


def test_allowed_ids_exclude_special_tokens(smollm2_path):
    from minivllm.bench.offline import allowed_token_ids
    from minivllm.gguf.reader import GGUFFile
    from minivllm.gguf.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(GGUFFile(smollm2_path))
    ids = set(allowed_token_ids(tok, tok.vocab_size).tolist())
    specials = {i for i in range(tok.vocab_size) if tok.is_special(i)}
    assert specials and not ids & specials
    assert tok.eos_id not in ids and len(ids) == tok.vocab_size - len(specials | {tok.eos_id, tok.bos_id} - {None})


def test_short_outputs_are_refused():
    """A request that stops short of its output length fails the run (no silent credit)."""
    from minivllm.bench.offline import run_once

    def out(n, reason="length"):
        return SimpleNamespace(token_ids=[1] * n, finish_reason=reason)

    class FakeLLM:
        model = SimpleNamespace(device=SimpleNamespace(type="cpu"))

        def __init__(self, outs):
            self.outs = outs

        def fork(self):
            return self

        def generate(self, prompts, params):
            assert [p.max_tokens for p in params] == [3, 2] and all(p.ignore_eos for p in params)
            return self.outs

        def snapshot(self):
            return {}

    assert run_once(FakeLLM([out(3), out(2)]), [[1], [2, 3]], [3, 2])["output_tokens"] == 5
    with pytest.raises(RuntimeError, match="request 1: 1 tokens"):
        run_once(FakeLLM([out(3), out(1, "stop")]), [[1], [2, 3]], [3, 2])


def test_offline_driver_tiny(results_dir, smollm2_path):
    from minivllm.bench.offline import run

    out = run(str(smollm2_path), num_seqs=5, input_len_range=(8, 24), output_len_range=(3, 9), seed=3, runs=1,
              max_runs=1)
    files = sorted(results_dir.glob("offline-*.json"))
    assert len(files) == 1 and files[0].with_name(files[0].name[:-5] + ".md").exists()
    assert [str(f) for f in sorted(results_dir.iterdir())] == sorted(out["files"])
    data = json.loads(files[0].read_text())
    meta = data["provenance"]
    assert PROVENANCE_KEYS <= set(meta) and len(meta["model_sha256"]) == 64
    s = meta["settings"]
    assert s["num_seqs"] == 5 and s["input_len_range"] == [8, 24] and s["output_len_range"] == [3, 9]
    assert s["runs_done"] == 1 and s["fresh_engine_per_run"] and s["max_model_len"] >= 24 + 9
    assert len(s["output_lens"]) == 5 and all(3 <= n <= 9 for n in s["output_lens"])
    assert all(8 <= n <= 24 for n in s["prompt_lens"])
    run_row, summary = data["rows"]
    # Every request produced exactly the output length it asked for.
    assert run_row["output_lens"] == s["output_lens"]
    assert run_row["output_tokens"] == sum(s["output_lens"]) and run_row["prompt_tokens"] == sum(s["prompt_lens"])
    assert run_row["output_tok_s"] == pytest.approx(run_row["output_tokens"] / run_row["wall_s"])
    assert run_row["total_tok_s"] == pytest.approx(
        (run_row["output_tokens"] + run_row["prompt_tokens"]) / run_row["wall_s"]
    )
    assert run_row["requests_s"] == pytest.approx(5 / run_row["wall_s"])
    assert summary["output_tok_s_mean"] == pytest.approx(run_row["output_tok_s"]) and summary["output_tok_s_std"] == 0
    md = files[0].with_name(files[0].name[:-5] + ".md").read_text()
    assert "| run | requests |" in md and "mean ± std (n=1)" in md and meta["commit"] in md
