"""`debug.compare` across devices, dtypes and engines.

References, none of them compare's own output: transformers' own `generate` over the same
ids (greedy tokens), a separate full transformers forward (logits), per-layer residual
streams captured here by forward hooks on every decoder layer (not through
`output_hidden_states`, which the transformers side uses) next to minivllm's one-chunk
forward, and an ordinary `LLM.generate` on its own load for a dtype or device side.
Float comparisons use the bounds of test_forward_reference.py: f32 logits within
DECODE_RTOL x max |logit| of transformers', greedy tokens equal up to transformers' first
near-tie.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import transformers_greedy

from minivllm import LLM, SamplingParams
from minivllm.debug import compare
from minivllm.debug.sides import parse_side
from minivllm.errors import ConfigError, EngineNotInstalledError

PROMPT = "The lighthouse keeper had not seen a ship in eleven years. On the night of the storm,"
N = 20
DECODE_RTOL = 2e-4  # a generated token's f32 logits vs transformers', times max |logit| (test_forward_reference)


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(str(smollm2_path), progress=False)


@pytest.fixture(scope="module")
def ref(smollm2_path):
    transformers = pytest.importorskip("transformers")
    p = smollm2_path
    return transformers.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32,
                                                             local_files_only=True).eval()


@pytest.fixture(scope="module")
def vs_transformers(llm):
    return compare(llm, PROMPT, a={}, b="transformers", max_tokens=N, top_k=5)


def _sure(margins: list[float], scales: list[float]) -> int:
    """Steps before transformers' first near-tie: two logits DECODE_RTOL off could swap there."""
    return next((i for i, (m, s) in enumerate(zip(margins, scales)) if m <= 2 * DECODE_RTOL * s), len(margins))


# -- bad sides ------------------------------------------------------------------------------


@pytest.mark.parametrize("side, match", [
    ("vllm", r"invalid b='vllm'.*transformers, llama\.cpp"),
    ({"device": "tpu"}, r"b\.device.*cpu, gpu, cuda or cuda:N"),
    ({"device": "cuda:99"}, r"b\.device.*give side b device 'cpu'"),
    ({"dtype": "f8"}, r"b\.dtype.*f32, f16, bf16"),
    ({"engine": "transformers", "dtype": "f16"}, r"b\.dtype.*float32 reference"),
    ({"engine": "transformers", "gemv_max_rows": 0}, r"b\.gemv_max_rows.*give them to a minivllm side"),
    ({"engine": "vllm"}, r"b\.engine.*minivllm, transformers, llama\.cpp"),
    ({"gemv_rows": 0}, r"b\.gemv_rows.*valid ones"),
])
def test_a_bad_side_is_refused_naming_it_before_any_model_loads(side, match):
    # The model name does not exist: the side check must come first to be seen at all.
    with pytest.raises(ConfigError, match=match):
        compare("no-such-model", "hi", a={}, b=side)


def test_cli_bad_side_is_one_clear_line():
    r = subprocess.run([sys.executable, "-m", "minivllm", "diverge", "--b", "device=tpu", "hello"],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert r.returncode == 2 and "b.device" in r.stderr and "Traceback" not in r.stderr, r.stderr


# -- minivllm vs transformers ------------------------------------------------------------------


def test_transformers_side_and_engine_follow_transformers_own_generate(vs_transformers, ref):
    report = vs_transformers
    theirs, margins, scales = transformers_greedy(ref, report.prompt_token_ids, N)
    n_sure = _sure(margins, scales)
    assert n_sure >= 4, f"transformers has a near-tie at step {n_sure}: pick another prompt"
    for side, ids in (("b (transformers)", report.b_token_ids), ("a (minivllm)", report.a_token_ids)):
        # min_new_tokens keeps EOS out of generate's choices: a side that ended is compared before its EOS.
        k = min(n_sure, len(ids) if len(ids) == N else len(ids) - 1)
        assert ids[:k] == theirs[:k], f"side {side}: {ids} vs generate's {theirs} (first near-tie at {n_sure})"
    assert report.a_settings["engine"] == "minivllm" and report.b_settings["engine"] == "transformers"
    assert (report.a_settings["device"], report.a_settings["dtype"]) == ("cpu", "f32")
    assert (report.b_settings["device"], report.b_settings["dtype"]) == ("cpu", "f32")
    assert report.machine["sides"]["b"] == {"engine": "transformers", "device": "cpu", "dtype": "f32"}
    assert report.b_options == {"engine": "transformers"}
    assert json.loads(json.dumps(report.to_dict()))["b_settings"]["engine"] == "transformers"


def test_recorded_top1_logits_match_an_independent_transformers_forward(vs_transformers, ref):
    report = vs_transformers
    split = report.first_divergence.position if report.first_divergence else len(report.records)
    n = min(split, len(report.a_token_ids), len(report.b_token_ids))
    assert n >= 4
    seq = report.prompt_token_ids + report.a_token_ids[:n - 1]
    with torch.no_grad():
        full = ref(torch.tensor([seq])).logits[0].float()
    p = len(report.prompt_token_ids)
    for rec in report.records[:n]:
        row = full[p - 1 + rec.position]
        bound = DECODE_RTOL * float(row.abs().max())
        for side in (rec.a, rec.b):
            top = side.top[0]
            assert abs(top.logit - float(row[top.token_id])) <= bound, (rec.position, top, float(row[top.token_id]))
            assert top.token_id == side.token_id


def _residual_streams_by_hooks(ref, ids: list[int]) -> torch.Tensor:
    """transformers' embedding output and every decoder layer's output (before the final
    norm), captured by forward hooks: (n_layers + 1, T, d)."""
    base = ref.model
    out: list[torch.Tensor] = []
    hooks = [base.embed_tokens.register_forward_hook(lambda m, a, o: out.append(o[0].float()))]
    hooks += [layer.register_forward_hook(lambda m, a, o: out.append((o[0] if isinstance(o, tuple) else o)[0].float()))
              for layer in base.layers]
    try:
        with torch.no_grad():
            ref(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(out)


def test_layer_report_lines_up_with_transformers_layers(vs_transformers, llm, ref):
    from minivllm.cache.contiguous import ContiguousKVCache

    report = vs_transformers
    n_layers = llm.config.n_layers
    diffs = report.layer_diffs
    assert [d.layer for d in diffs] == ["embedding"] + [f"layer {i}" for i in range(n_layers)]
    assert all(d.comparable for d in diffs), report.layer_note
    for d in diffs:
        assert all(math.isfinite(x) for x in (d.prefix_rel_l2, d.at_split_rel_l2, d.prefix_max_abs)), d
    # Both f32: the residual streams agree to rounding. A last entry compared after
    # transformers' final norm against minivllm's pre-norm stream would be off by O(1).
    assert max(d.prefix_rel_l2 for d in diffs) < 1e-3, [d.prefix_rel_l2 for d in diffs]
    # The same quantity computed here: one forward each over the prompt, transformers'
    # layers read by hooks, minivllm's record of forward(hidden_states=[]).
    ids = report.prompt_token_ids
    theirs = _residual_streams_by_hooks(ref, ids)
    cfg, model = llm.config, llm.model
    cache = ContiguousKVCache(cfg.n_layers, len(ids), cfg.n_kv_heads, cfg.head_dim, model.dtype, model.device)
    hidden: list[torch.Tensor] = []
    with model.using(llm.engine.kernel_options):
        model.forward(torch.tensor(ids), 0, cache, hidden_states=hidden)
    ours = torch.stack(hidden)
    assert ours.shape == theirs.shape
    here = ((theirs - ours).double().norm(dim=(1, 2)) / ours.double().norm(dim=(1, 2))).tolist()
    for d, mine in zip(diffs, here):
        # Over more rows (the generated ones too) and another chunking: the same order of size.
        assert d.prefix_rel_l2 <= 10 * mine + 1e-7 and mine <= 10 * d.prefix_rel_l2 + 1e-7, (
            d.layer,
            d.prefix_rel_l2,
            mine,
        )
    # Where b first leaves a: the earliest position any layer differs at, and the first
    # layer differing there.
    first = report.first_layer_difference
    assert first is not None, "minivllm and transformers sum in different orders: some layer must differ"
    positions = [d.first_differing_position for d in diffs]
    assert first["position"] == min(p for p in positions if p is not None)
    assert first["layer"] == diffs[positions.index(first["position"])].layer
    assert f"b first leaves a at {first['layer']}" in report.summary()
    # The replay of transformers' side (one forward over the sequence) reproduces its
    # token-by-token logits at the last compared row.
    assert report.replay is not None and report.replay.b_top_logits_max_abs_diff < 1e-3


def test_llama_cpp_side_gives_logits_and_says_it_has_no_layers(llm, smollm2_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    try:
        report = compare(llm, PROMPT, a={}, b="llama.cpp", max_tokens=6, top_k=3)
    except EngineNotInstalledError as exc:
        pytest.skip(str(exc))
    assert report.layer_diffs == [] and "no hidden states" in report.layer_note
    assert report.b_settings["engine"] == "llama.cpp"
    # An independent llama.cpp run over the same ids through its C API (not `scores`).
    import numpy as np

    ref = llama_cpp.Llama(model_path=str(smollm2_path), n_ctx=256, n_gpu_layers=0, verbose=False)
    ref.eval(report.prompt_token_ids)
    n_vocab = ref.n_vocab()
    for rec in report.records:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ref.ctx, -1), shape=(n_vocab,))
        assert rec.b.token_id == int(np.argmax(logits)), rec.position
        assert rec.b.top[0].logit == pytest.approx(float(logits.max()), rel=1e-4, abs=1e-4)
        ref.eval([rec.b.token_id])


# -- device and dtype sides ----------------------------------------------------------------------


def test_a_side_on_the_base_device_and_dtype_forks_it(llm):
    report = compare(llm, PROMPT, a={"device": "cpu", "dtype": "f32"}, b={"gemv_max_rows": 0}, max_tokens=2,
                     hidden_states=False)
    for settings in (report.a_settings, report.b_settings):
        assert settings["weights"] == "shared with the base LLM (fork)" and settings["dtype"] == "f32"


def test_f32_side_vs_bf16_side_each_run_their_own_dtype(llm, smollm2_path):
    report = compare(llm, PROMPT, a={}, b={"dtype": "bf16"}, max_tokens=12, top_k=3)
    assert report.a_settings["dtype"] == "f32" and report.b_settings["dtype"] == "bf16"
    assert report.a_settings["weights"].startswith("shared") and report.b_settings["weights"].startswith("own load")
    assert report.machine["sides"]["b"]["dtype"] == "bf16"
    # Each side is an ordinary generation in its dtype (the bf16 one on its own load).
    params = SamplingParams(temperature=0.0, max_tokens=12)
    assert report.a_token_ids == llm.generate(PROMPT, params)[0].token_ids
    bf16 = LLM(str(smollm2_path), dtype="bf16", progress=False)
    assert report.b_token_ids == bf16.generate(PROMPT, params)[0].token_ids
    # bf16 rounds: the recorded logits are not f32's.
    common = [r for r in report.records if r.a is not None and r.b is not None]
    assert any(r.a.top[0].logit != r.b.top[0].logit for r in common)
    # Different dtypes: a layer table even without a split, finite and not zero.
    diffs = report.layer_diffs
    assert len(diffs) == llm.config.n_layers + 1
    assert all(math.isfinite(d.prefix_rel_l2) for d in diffs) and 0 < diffs[-1].prefix_rel_l2 < 0.5
    assert "dtype=bf16" in report.summary()


# -- CUDA ------------------------------------------------------------------------------------------
# A synthetic model (tests/synthetic_gguf.py): the GPU machine has no model mirror.


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from synthetic_gguf import T, random_token_ids, write_tiny_model

    path = write_tiny_model(tmp_path_factory.mktemp("sides") / "tiny.gguf", weight_type=T.Q8_0, n_layers=2,
                            d_model=256, d_ff=512, n_heads=4, n_kv_heads=2, vocab_size=512, seed=5, weight_std=0.3)
    return path, random_token_ids(16, seed=7)


@pytest.mark.cuda
def test_cpu_side_vs_cuda_f16_side(tiny):
    path, ids = tiny
    report = compare(str(path), ids, a={"device": "cpu"}, b={"device": "cuda:0", "dtype": "f16"}, max_tokens=8)
    assert (report.a_settings["device"], report.a_settings["dtype"]) == ("cpu", "f32")
    assert report.b_settings["device"].startswith("cuda:0") and report.b_settings["dtype"] == "f16"
    assert report.machine["gpu"] and report.machine["sides"]["b"]["device"].startswith("cuda:0")
    own = LLM(str(path), device="cuda:0", dtype="f16", progress=False)
    assert report.b_token_ids == own.generate(ids, SamplingParams(temperature=0.0, max_tokens=8))[0].token_ids
    assert len(report.layer_diffs) == 3
    assert all(math.isfinite(d.prefix_rel_l2) and d.prefix_rel_l2 < 0.1 for d in report.layer_diffs), report.layer_diffs


@pytest.mark.cuda
def test_cuda_engine_vs_cuda_transformers(tiny):
    from synthetic_gguf import transformers_logits, transformers_model

    path, ids = tiny
    report = compare(str(path), ids, a={"device": "cuda:0"}, b={"engine": "transformers", "device": "cuda:0"},
                     max_tokens=8)
    assert report.b_settings["device"].startswith("cuda:0") and report.b_settings["engine"] == "transformers"
    assert all(d.comparable and d.prefix_rel_l2 < 1e-3 for d in report.layer_diffs), report.layer_diffs
    split = report.first_divergence.position if report.first_divergence else len(report.records)
    n = min(split, len(report.a_token_ids))
    full = transformers_logits(transformers_model(path), ids + report.a_token_ids[:n])  # CPU, float32
    for rec in report.records[:n]:
        row = full[len(ids) - 1 + rec.position]
        bound = 1e-3 * float(row.abs().max())  # TF32 is off by default, but GPU reductions sum in other orders
        assert abs(rec.a.top[0].logit - float(row[rec.a.token_id])) <= bound, rec.position


def test_a_constrained_side_shows_what_the_mask_removed(llm):
    """Side b decodes under a choice constraint: its text is one of the choices, its
    recorded top-k at the first position holds only tokens that start a choice (the rest
    at -inf), and those keep the logits side a saw for them."""
    choices = ["yes", "no"]
    report = compare(llm, "Is water wet? Answer yes or no.", a={}, b={"structured": {"choice": choices}},
                     max_tokens=8, chat=True, hidden_states=False)
    assert report.b_text in choices
    assert report.b_settings["structured"].startswith("choice")
    first = report.records[0]
    finite = [t for t in first.b.top if t.logit != float("-inf")]
    assert finite and all(any(c.startswith(t.text) for c in choices) for t in finite)
    a_logits = {t.token_id: t.logit for t in first.a.top}
    for t in finite:
        if t.token_id in a_logits:
            assert t.logit == a_logits[t.token_id]


def test_a_constraint_on_a_reference_side_is_refused():
    with pytest.raises(ConfigError, match="b.structured"):
        parse_side({"engine": "transformers", "structured": {"regex": "a+"}}, "b")
