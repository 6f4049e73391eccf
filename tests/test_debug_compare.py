"""`minivllm.debug.compare` and `minivllm diverge`.

The committed case (data/divergence/) compares the engine against itself under two
kernel settings: that is the claim being tested (their difference flips a greedy token
after a long identical prefix), so no outside reference applies there. Elsewhere the
recorded logits are checked against a separate forward of the prompt, and identical
settings must give bit-identical hidden states.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.cache.contiguous import ContiguousKVCache
from minivllm.debug import DivergenceReport, compare
from minivllm.debug.engine_options import engine_option_names, parse_assignments, parse_option_value
from minivllm.debug.hidden_state_diff import diff_hidden_states, engine_forward_schedule
from minivllm.errors import ConfigError

from conftest import DATA_DIR

CASE = DATA_DIR / "divergence" / "smollm2-gemm-vs-gemv.json"
PROMPT = "The lighthouse keeper had not seen a ship in eleven years. On the night of the storm,"


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(str(smollm2_path), progress=False)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minivllm", *args], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ))


# -- options -----------------------------------------------------------------------------


def test_option_values_parse_like_a_user_writes_them():
    assert [parse_option_value(v) for v in ("0", "4096", "0.5", "true", "False", "none", "auto", "paged")] == \
        [0, 4096, 0.5, True, False, None, "auto", "paged"]
    assert parse_assignments(["gemv_max_rows=0", "batch-invariant=yes", "kv_mode=contiguous"], "a") == \
        {"gemv_max_rows": 0, "batch_invariant": True, "kv_mode": "contiguous"}
    assert {"gemv_max_rows", "max_batched_tokens", "batch_invariant", "dequant_cache", "kv_mode"} <= \
        set(engine_option_names())


def test_unknown_option_is_refused_before_any_model_is_loaded():
    # The model name does not exist: the option check must come first to be seen at all.
    with pytest.raises(ConfigError, match=r"b\.gemv_rows.*valid ones: .*gemv_max_rows"):
        compare("no-such-model", "hi", a={"gemv_max_rows": 0}, b={"gemv_rows": 0})
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_assignments(["gemv_max_rows"], "a")


def test_cli_unknown_option_is_one_clear_line():
    r = _cli("diverge", "--a", "gemv_max_rows=0", "--b", "gemv_rows=4096", "hello")
    assert r.returncode == 2
    assert "b.gemv_rows" in r.stderr and "gemv_max_rows" in r.stderr and "Traceback" not in r.stderr


def test_replay_schedule_is_the_engines_for_a_lone_request():
    # Prompt in max_batched_tokens chunks, then one decode row per generated token.
    assert engine_forward_schedule(10, 13, 4) == [(0, 4), (4, 4), (8, 2), (10, 1), (11, 1), (12, 1)]
    assert engine_forward_schedule(3, 3, 512) == [(0, 3)]


# -- identical settings ------------------------------------------------------------------------


def test_identical_options_report_no_divergence(llm):
    opts = {"gemv_max_rows": 0}
    report = compare(llm, PROMPT, a=opts, b=dict(opts), max_tokens=12, top_k=3)
    assert report.first_divergence is None and not report.diverged
    assert report.a_token_ids == report.b_token_ids and len(report.records) == 12
    assert all(r.same for r in report.records) and report.layer_diffs == []
    # Each side is an ordinary generation under its options.
    expected = llm.fork(**opts).generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12))[0]
    assert report.a_token_ids == expected.token_ids and report.a_text == expected.text
    for rec in report.records:
        assert len(rec.a.top) == 3 and rec.a.top[0].token_id == rec.a.token_id
        assert rec.a.margin == pytest.approx(rec.a.top[0].logit - rec.a.top[1].logit) and rec.a.margin >= 0
    # The recorded logits of the first position are the prompt's last-row logits: a separate
    # single-chunk forward through a contiguous cache gives the same top-k.
    model, cfg = llm.model, llm.config
    ids = llm.tokenizer.encode(PROMPT)
    cache = ContiguousKVCache(cfg.n_layers, len(ids), cfg.n_kv_heads, cfg.head_dim, model.dtype, model.device)
    with model.using(llm.fork(**opts).engine.kernel_options):
        logits = model.forward(torch.tensor(ids), 0, cache)
    values, top_ids = torch.topk(logits, 3)
    assert [t.token_id for t in report.records[0].a.top] == top_ids.tolist()
    assert [t.logit for t in report.records[0].a.top] == pytest.approx(values.tolist(), abs=1e-4)
    # Notebook-friendly: one-line repr, JSON round trip, readable summary.
    assert "no divergence" in repr(report) and "\n" not in repr(report)
    assert json.loads(json.dumps(report.to_dict()))["first_divergence"] is None
    assert "No divergence" in report.summary()


def test_layer_diffs_are_exactly_zero_for_identical_options(llm):
    ids = llm.tokenizer.encode(PROMPT)
    n_prompt = len(ids) - 5  # five decode rows after the prefill, like a generation
    side_1, side_2 = llm.fork(gemv_max_rows=4096, max_batched_tokens=8), llm.fork(gemv_max_rows=4096, max_batched_tokens=8)
    diffs, logits_1, logits_2 = diff_hidden_states(side_1, side_2, ids, n_prompt)
    assert len(diffs) == llm.config.n_layers + 1 and diffs[0].layer == "embedding"
    for d in diffs:
        assert (d.at_split_max_abs, d.at_split_rel_l2, d.prefix_max_abs, d.prefix_rel_l2) == (0, 0, 0, 0), d
        assert d.first_differing_position is None
    assert torch.equal(logits_1, logits_2)


# -- the committed case --------------------------------------------------------------------------


def test_committed_case_still_splits_where_it_did(smollm2_path, tmp_path):
    """GEMM vs row-wise GEMV: the same greedy tokens for a long prefix, then a flip."""
    case = json.loads(CASE.read_text())
    fd = case["first_divergence"]
    from minivllm.debug.compare import _model_sha256

    assert _model_sha256(smollm2_path) == case["model_sha256"], "the case was recorded on a different model file"
    assert fd["identical_tokens"] >= 50
    args = ["diverge", "--model", str(smollm2_path), "--max-tokens", str(fd["position"] + 1), "--quiet",
            "--json", str(tmp_path / "rerun.json")]
    for side in ("a", "b"):
        for key, value in case[f"{side}_options"].items():
            args += [f"--{side}", f"{key}={value}"]
    if case["chat"]:
        args.append("--chat")
    r = _cli(*args, case["prompt"])
    assert r.returncode == 0, r.stderr
    rerun = json.loads((tmp_path / "rerun.json").read_text())
    assert rerun["prompt_token_ids"] == case["prompt_token_ids"]
    got = rerun["first_divergence"]
    assert got is not None, "the two settings no longer split within the recorded prefix"
    assert (got["position"], got["a_token"]["token_id"], got["b_token"]["token_id"]) == \
        (fd["position"], fd["a_token"]["token_id"], fd["b_token"]["token_id"])
    assert got["shared_text"] == fd["shared_text"]
    # The printed report: the shared prefix, both continuations, top-k, the layer table.
    assert fd["shared_text"].strip()[:40] in r.stdout
    assert "--- a continues ---" in r.stdout and "--- b continues ---" in r.stdout and "layer 0" in r.stdout

    # Where the difference lives: not in the embedding lookup (same table, no matmul),
    # then in every layer from some layer on, over the prefix the KV cache holds.
    layers = rerun["layer_diffs"]
    assert layers[0]["layer"] == "embedding" and layers[0]["prefix_max_abs"] == 0
    nonzero = [d["prefix_max_abs"] > 0 for d in layers]
    first = nonzero.index(True)
    assert all(nonzero[first:]), layers
    assert layers[-1]["at_split_max_abs"] > 0
    # The difference is already there before the split (it came through the cache).
    assert layers[-1]["first_differing_position"] < got["sequence_position"]
    # The replay reproduces each side's own choice at the split, so the table describes it.
    assert (rerun["replay"]["a_token"], rerun["replay"]["b_token"]) == \
        (fd["a_token"]["token_id"], fd["b_token"]["token_id"])
    assert set(rerun) >= set(DivergenceReport.__dataclass_fields__)
