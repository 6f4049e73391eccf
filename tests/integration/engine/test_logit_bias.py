"""logit_bias: validated like OpenAI's, added to the raw logits of every kind of draw.

References, none recorded from the engine itself:

* the sampled distribution is the softmax of (logits + bias) / temperature written out in
  float64 numpy, and a seeded draw's frequencies are checked against it (chi-square);
* on SmolLM2-135M, every greedy token of a biased request is the numpy argmax of the raw
  logits the engine's logits hook saw at that step plus the bias (for a constrained row,
  of its masked logits plus the bias): the bias flips the argmax where it is large enough,
  and the test checks that it did;
* a -100 bias on every token an unbiased run produced keeps all of them out of the biased
  text (greedy and sampled);
* batched and alone in batch-invariant mode, a request's tokens are the same;
* with a draft model (a perturbed copy of SmolLM2), greedy speculation reproduces the
  non-speculative biased output token for token, and that output differs from the
  unbiased one (so a verification that ignored the bias would fail here).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minivllm.engine.engine import LLMEngine
from minivllm.engine.engine_config import EngineConfig
from minivllm.engine.llm import LLM
from minivllm.errors import ConfigError
from minivllm.sampling.sampler import apply_penalties, filtered_probs, sample
from minivllm.sampling.sampling_params import SamplingParams
from minivllm.sampling.structured import StructuredOutput
from minivllm.spec.drafter import processed_logits

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "The capital of France is"
OPTIONS = dict(max_model_len=256, batch_invariant=True)


# -- validation -------------------------------------------------------------------------


@pytest.mark.parametrize("bias, field, says", [
    ({"5": 100.5}, "logit_bias[5]", "[-100, 100]"),
    ({5: -101}, "logit_bias[5]", "[-100, 100]"),
    ({5: float("nan")}, "logit_bias[5]", "[-100, 100]"),
    ({5: float("inf")}, "logit_bias[5]", "[-100, 100]"),
    ({5: True}, "logit_bias[5]", "[-100, 100]"),
    ({"-3": 1.0}, "logit_bias", "token ids"),
    ({"1.5": 1.0}, "logit_bias", "token ids"),
    ({"abc": 1.0}, "logit_bias", "token ids"),
    ({True: 1.0}, "logit_bias", "token ids"),
    ({i: 1.0 for i in range(301)}, "logit_bias", "at most 300"),
    ([1, 2], "logit_bias", "object"),
])
def test_bad_logit_bias_is_refused_naming_the_field(bias, field, says):
    with pytest.raises(ConfigError) as exc:
        SamplingParams(logit_bias=bias)
    assert exc.value.field == field and says in str(exc.value), str(exc.value)


def test_logit_bias_keys_from_json_become_ints_and_empty_is_none():
    p = SamplingParams(logit_bias={"12": 5, "0": -100.0, 7: 100})
    assert p.logit_bias == {12: 5.0, 0: -100.0, 7: 100.0}
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert len(SamplingParams(logit_bias={i: 1 for i in range(300)}).logit_bias) == 300
    with pytest.raises(ConfigError, match=r"logit_bias.*\[0, 100\)"):
        SamplingParams(logit_bias={"100": 1.0}).check_token_ids(100)
    SamplingParams(logit_bias={"99": 1.0}).check_token_ids(100)


# -- the sampler, by hand -----------------------------------------------------------------

LOGITS = [1.3, -0.2, 2.1, 0.4, -1.5, 0.9]
BIAS = {1: 2.5, 2: -1.75, 4: 3.0}


def biased_softmax(temperature: float) -> np.ndarray:
    z = np.array(LOGITS, dtype=np.float64)
    for t, b in BIAS.items():
        z[t] += b
    z /= temperature
    e = np.exp(z - z.max())
    return e / e.sum()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_probabilities_are_the_softmax_of_the_biased_logits(temperature):
    p = SamplingParams(temperature=temperature, logit_bias=BIAS)
    got = filtered_probs(apply_penalties(torch.tensor(LOGITS), [], [], p), p)
    np.testing.assert_allclose(got.numpy(), biased_softmax(temperature), atol=1e-6, rtol=0)
    # The draw itself follows it: 20k seeded draws, chi-square with 5 degrees of freedom
    # (99.9% quantile 20.5).
    g = torch.Generator().manual_seed(0)
    n = 20000
    counts = np.bincount([sample(torch.tensor(LOGITS), [], [], p, g) for _ in range(n)], minlength=len(LOGITS))
    want = biased_softmax(temperature) * n
    chi2 = float(((counts - want) ** 2 / want).sum())
    assert chi2 < 20.5, (counts, want)


def test_greedy_argmax_flips_with_a_large_bias_and_minus_100_bans():
    logits = torch.tensor(LOGITS)
    assert sample(logits, [], [], SamplingParams(temperature=0), None) == 2
    assert sample(logits, [], [], SamplingParams(temperature=0, logit_bias={5: 1.3}), None) == 5  # 2.2 > 2.1
    assert sample(logits, [], [], SamplingParams(temperature=0, logit_bias={5: 1.1}), None) == 2  # 2.0 < 2.1
    banned = SamplingParams(temperature=1.0, logit_bias={2: -100, 0: -100})
    probs = filtered_probs(apply_penalties(logits.clone(), [], [], banned), banned)
    assert float(probs[2]) < 1e-40 and float(probs[0]) < 1e-40


def test_bias_comes_before_penalties_and_reaches_the_speculative_rows():
    # Repetition penalty 2 on token 0, bias +1 on it: (1.3 + 1) / 2, not 1.3 / 2 + 1.
    p = SamplingParams(repetition_penalty=2.0, logit_bias={0: 1.0, 3: -0.5})
    got = apply_penalties(torch.tensor(LOGITS), [0], [], p).tolist()
    want = list(LOGITS)
    want[0], want[3] = (1.3 + 1.0) / 2.0, 0.4 - 0.5
    np.testing.assert_allclose(got, want, atol=1e-6)
    # Verification and drafting process rows through processed_logits: the bias is there,
    # and ids past a shorter shared vocabulary are left out.
    row = processed_logits(torch.tensor(LOGITS), [], [], SamplingParams(logit_bias={1: 2.0, 5: 9.0}), vocab=5)
    np.testing.assert_allclose(row.tolist(), [1.3, 1.8, 2.1, 0.4, -1.5], atol=1e-6)


# -- the engine, on SmolLM2 ---------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(str(smollm2_path), progress=False, **OPTIONS)


def run(engine: LLMEngine, jobs: list[tuple[list[int], SamplingParams]], seen: dict | None = None) -> list[list[int]]:
    """All jobs at once in one engine; their token ids. `seen` collects what the logits
    hook reports per request (the rows the tokens were drawn from, before any bias)."""
    if seen is not None:
        engine.logits_hook = lambda rid, row: seen.setdefault(rid, []).append(row.detach().float().clone())
    rids = [engine.add_request(ids, p) for ids, p in jobs]
    while engine.has_unfinished():
        engine.step()
    engine.logits_hook = None
    return [engine.pop_output(r).token_ids for r in rids]


def numpy_argmax_with_bias(row: torch.Tensor, bias: dict) -> int:
    z = row.double().numpy().copy()
    for t, b in bias.items():
        z[t] += b
    return int(np.argmax(z))


def flipping_bias(llm, ids: list[int]) -> dict[int, float]:
    """A bias that makes the first greedy token the model's second choice, just: its
    margin plus 0.5 on the runner-up."""
    seen: dict = {}
    engine = llm.fork().engine
    run(engine, [(ids, SamplingParams(temperature=0, max_tokens=1))], seen)
    row = next(iter(seen.values()))[0]
    top = torch.topk(row, 2)
    return {int(top.indices[1]): float(top.values[0] - top.values[1]) + 0.5}


def test_every_greedy_token_is_the_argmax_of_the_biased_logits(llm):
    ids = llm.tokenizer.encode(PROMPT)
    bias = flipping_bias(llm, ids)
    runner_up = next(iter(bias))
    bias.update({int(t): -100.0 for t in llm.tokenizer.encode(" Paris")})  # and a ban, for good measure
    seen: dict = {}
    (tokens,) = run(llm.fork().engine, [(ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                             logit_bias=bias))], seen)
    rows = next(iter(seen.values()))
    assert len(rows) == len(tokens) == 12
    assert tokens[0] == runner_up  # the flip happened
    assert tokens == [numpy_argmax_with_bias(r, bias) for r in rows]


def test_minus_100_keeps_tokens_out_of_the_text(llm):
    ids = llm.tokenizer.encode(PROMPT)
    (plain,) = run(llm.fork().engine, [(ids, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))])
    banned = {t: -100 for t in set(plain)}
    jobs = [(ids, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logit_bias=banned)),
            (ids, SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True, logit_bias=banned))]
    for tokens in run(llm.fork().engine, jobs):
        assert len(tokens) == 24 and not set(tokens) & set(plain), (tokens, plain)


def test_batched_equals_alone(llm):
    """Different biases side by side in one batch, greedy and seeded, against each alone
    (batch-invariant mode: the same arithmetic whatever the batch)."""
    prompts = [PROMPT, "Three colours of the rainbow are", "def add(a, b):"]
    jobs = []
    for k, text in enumerate(prompts):
        ids = llm.tokenizer.encode(text)
        bias = flipping_bias(llm, ids)
        jobs.append((ids, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logit_bias=bias)))
        jobs.append((ids, SamplingParams(temperature=0.9, seed=k, max_tokens=10, ignore_eos=True,
                                         logit_bias={**bias, 13: 4.0})))
    jobs.append((llm.tokenizer.encode(PROMPT), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)))
    together = run(llm.fork().engine, jobs)
    alone = [run(llm.fork().engine, [job])[0] for job in jobs]
    assert together == alone
    assert together[0] != together[-1]  # the same prompt, biased or not, differs


def test_a_constrained_row_takes_the_argmax_of_its_masked_biased_logits(llm):
    ids = llm.tokenizer.encode("Is the sky green? Answer:")
    choice = StructuredOutput(choice=[" yes", " no", " maybe"])
    (plain,) = run(llm.fork().engine, [(ids, SamplingParams(temperature=0, max_tokens=4, structured=choice))])
    bias = {plain[0]: -100.0}  # ban the unbiased answer's first token: another answer must win
    seen: dict = {}
    (tokens,) = run(llm.fork().engine, [(ids, SamplingParams(temperature=0, max_tokens=4, structured=choice,
                                                             logit_bias=bias))], seen)
    assert tokens[0] != plain[0]
    text = llm.tokenizer.decode(tokens)
    assert text in choice.choice, text
    rows = next(iter(seen.values()))
    # Each reported row is the masked one (forbidden tokens at -inf), before the bias.
    for token, row in zip(tokens, rows):
        assert token == numpy_argmax_with_bias(row, bias)


def test_speculation_verifies_against_the_biased_target(llm, smollm2_path):
    from minivllm.spec.perturbed_draft import perturbed_copy

    draft = perturbed_copy(smollm2_path, noise=0.3, seed=0)
    ids = llm.tokenizer.encode("Once upon a time, in a small village,")
    (plain,) = run(llm.fork().engine, [(ids, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))])
    bias = {t: -100.0 for t in set(plain[:6])}
    bias.update(flipping_bias(llm, ids))
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logit_bias=bias)
    (want,) = run(llm.fork().engine, [(ids, params)])
    assert want != plain
    engine = LLMEngine(llm.model, llm.tokenizer, EngineConfig(**OPTIONS, draft_policy="fixed:4"),
                       draft_model=draft, draft_tokenizer=llm.tokenizer)
    rid = engine.add_request(ids, params)
    while engine.has_unfinished():
        engine.step()
    out = engine.pop_output(rid)
    spec = out.metrics.speculation
    assert spec["proposed"] > 0 and spec["accepted"] > 0, spec
    assert out.token_ids == want
