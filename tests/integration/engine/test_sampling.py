"""Sampling: parameter validation, the exact filtered distribution, penalties, the draw
itself, seeds, stop strings, and end-to-end stop conditions on the real smollm2 model.

References are independent of minivllm: distributions are recomputed here in float64
numpy from the definitions, penalties by hand, stop-string behaviour by a brute-force
simulation over the whole text received so far.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from minivllm.engine.llm import LLM
from minivllm.errors import ConfigError
from minivllm.sampling.sampler import apply_penalties, filtered_probs, make_generator, sample
from minivllm.sampling.sampling_params import SamplingParams
from minivllm.sampling.stop_strings import StopStringMatcher

# --- SamplingParams validation ---------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", 2.0),
        ("min_p", -0.1),
        ("max_tokens", 0),
        ("repetition_penalty", 0.0),
        ("repetition_window", -1),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("seed", -1),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
    ],
)
def test_invalid_params_raise_config_error(field, value):
    with pytest.raises(ConfigError) as exc:
        SamplingParams(**{field: value})
    assert exc.value.field == field
    assert field in str(exc.value)
    assert isinstance(exc.value, ValueError)


def test_param_normalisation():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=0.5).greedy
    # boundaries that are allowed
    SamplingParams(top_p=1.0, min_p=1.0, presence_penalty=2, frequency_penalty=-2, seed=0, max_tokens=1)


# --- filtered_probs: exact math ----------------------------------------------------------------

LOGITS = [1.3, -0.2, 2.1, 0.4, -1.5, 0.9]  # no ties


def ref_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The definition, in float64: temperature, softmax, top-k, top-p (smallest prefix of
    the sorted distribution whose mass reaches top_p), min-p (relative to the max)."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_k:
        keep = np.argsort(-p, kind="stable")[:top_k]
        mask = np.zeros_like(p, dtype=bool)
        mask[keep] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    if top_p < 1.0:
        kept, mass = [], 0.0
        for i in np.argsort(-p, kind="stable"):
            kept.append(i)
            mass += p[i]
            if mass >= top_p:
                break
        mask = np.zeros_like(p, dtype=bool)
        mask[kept] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    if min_p > 0.0:
        p = np.where(p >= min_p * p.max(), p, 0.0)
        p /= p.sum()
    return p


def _assert_not_near_boundary(logits, temperature, top_k, top_p, min_p):
    """Keep the float32 implementation away from float64 ties with the thresholds."""
    p = ref_probs(logits, temperature, top_k)
    if top_p < 1.0:
        cum = np.cumsum(np.sort(p)[::-1])
        assert np.min(np.abs(cum - top_p)) > 1e-4
    if min_p > 0.0:
        q = ref_probs(logits, temperature, top_k, top_p)
        q = q[q > 0]
        assert np.min(np.abs(q / q.max() - min_p)) > 1e-4


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p",
    [
        (1.0, 0, 1.0, 0.0),
        (0.5, 0, 1.0, 0.0),
        (2.0, 0, 1.0, 0.0),
        (1.0, 1, 1.0, 0.0),
        (1.0, 3, 1.0, 0.0),
        (0.7, 5, 1.0, 0.0),
        (1.0, 0, 0.3, 0.0),
        (1.0, 0, 0.6, 0.0),
        (1.0, 0, 0.9, 0.0),
        (1.5, 0, 0.8, 0.0),
        (1.0, 0, 1.0, 0.2),
        (1.0, 0, 1.0, 0.5),
        (2.0, 0, 1.0, 0.35),
        (1.0, 4, 0.8, 0.0),
        (0.8, 4, 0.95, 0.1),
        (1.3, 0, 0.85, 0.3),
        (1.0, 6, 1.0, 0.0),  # top_k == vocab: no-op
        (1.0, 10, 1.0, 0.0),  # top_k > vocab: no-op
    ],
)
def test_filtered_probs_exact(temperature, top_k, top_p, min_p):
    _assert_not_near_boundary(LOGITS, temperature, top_k, top_p, min_p)
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    got = filtered_probs(torch.tensor(LOGITS), p)
    want = ref_probs(LOGITS, temperature, top_k, top_p, min_p)
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), want, atol=1e-6, rtol=0)
    assert ((got.numpy() == 0) == (want == 0)).all()  # same support, exactly


def test_filtered_probs_hand_values():
    """A couple of fully hand-written cases, not even via ref_probs."""
    logits = torch.tensor([math.log(x) for x in (1.0, 2.0, 3.0, 4.0)])
    got = filtered_probs(logits, SamplingParams(temperature=1.0))
    np.testing.assert_allclose(got.numpy(), [0.1, 0.2, 0.3, 0.4], atol=1e-6)
    # temperature 0.5 squares the odds: 1:4:9:16
    got = filtered_probs(logits, SamplingParams(temperature=0.5))
    np.testing.assert_allclose(got.numpy(), np.array([1, 4, 9, 16]) / 30, atol=1e-6)
    # top-k 2 keeps 3 and 4
    got = filtered_probs(logits, SamplingParams(top_k=2))
    np.testing.assert_allclose(got.numpy(), [0, 0, 3 / 7, 4 / 7], atol=1e-6)
    # min-p 0.6: keep p >= 0.24 -> 0.3 and 0.4
    got = filtered_probs(logits, SamplingParams(min_p=0.6))
    np.testing.assert_allclose(got.numpy(), [0, 0, 3 / 7, 4 / 7], atol=1e-6)


@pytest.mark.parametrize(
    "top_p, kept",
    [
        (0.5, 1),  # the top token's mass is exactly 0.5: it alone reaches p
        (0.5000001, 2),
        (0.75, 2),  # 16/32 + 8/32 = exactly 0.75
        (0.875, 3),  # exactly 28/32
        (0.9, 4),
        (0.96875, 4),  # exactly 31/32
        (0.97, 5),
    ],
)
def test_top_p_exact_boundary(top_p, kept):
    """Dyadic probabilities (16, 8, 4, 3, 1)/32 are exact in float32 and float64, so p can
    land exactly on a cumulative mass: the prefix that *reaches* p is kept, nothing more."""
    weights = [16.0, 8.0, 4.0, 3.0, 1.0]
    logits = [math.log(w) for w in weights]
    got = filtered_probs(torch.tensor(logits), SamplingParams(top_p=top_p)).numpy()
    w = np.array(weights)
    w[kept:] = 0
    np.testing.assert_allclose(got, w / w.sum(), atol=1e-6, rtol=0)
    assert (got > 0).sum() == kept
    np.testing.assert_allclose(got, ref_probs(logits, top_p=top_p), atol=1e-6)


def test_filtered_probs_unsorted_input_order_preserved():
    """top-p sorts internally; the result must be scattered back to vocabulary order."""
    logits = [0.1, 3.0, -1.0, 2.5, 0.0, 1.0]
    got = filtered_probs(torch.tensor(logits), SamplingParams(top_p=0.7)).numpy()
    np.testing.assert_allclose(got, ref_probs(logits, top_p=0.7), atol=1e-6)
    assert got[1] > got[3] > 0 and got[0] == got[2] == got[4] == 0


# --- penalties ------------------------------------------------------------------------------

BASE = [2.0, -1.0, 0.5, -3.0, 1.0, 0.0, 4.0]


def _pen(context, output, **kw):
    return apply_penalties(torch.tensor(BASE), context, output, SamplingParams(**kw)).tolist()


def test_repetition_penalty_whole_context():
    got = _pen([0, 1, 3, 0, 5], [], repetition_penalty=2.0)
    # seen: 0 (2.0 -> 1.0), 1 (-1 -> -2), 3 (-3 -> -6), 5 (0 -> 0); others untouched
    want = [1.0, -2.0, 0.5, -6.0, 1.0, 0.0, 4.0]
    np.testing.assert_allclose(got, want, atol=1e-6)
    # penalty < 1 boosts: divide positive by 0.5, multiply negative by 0.5
    got = _pen([0, 1], [], repetition_penalty=0.5)
    np.testing.assert_allclose(got, [4.0, -0.5, 0.5, -3.0, 1.0, 0.0, 4.0], atol=1e-6)


def test_repetition_penalty_window():
    # window 2 -> only the last two context ids (3 and 6) are penalised; 0 and 1 are older
    got = _pen([0, 1, 3, 6], [], repetition_penalty=4.0, repetition_window=2)
    want = [2.0, -1.0, 0.5, -12.0, 1.0, 0.0, 1.0]
    np.testing.assert_allclose(got, want, atol=1e-6)
    # a repeated id inside the window is penalised once, not twice
    got = _pen([2, 6, 6], [], repetition_penalty=2.0, repetition_window=2)
    np.testing.assert_allclose(got, [2.0, -1.0, 0.5, -3.0, 1.0, 0.0, 2.0], atol=1e-6)
    # window larger than the context = whole context
    got = _pen([0, 2], [], repetition_penalty=2.0, repetition_window=100)
    np.testing.assert_allclose(got, [1.0, -1.0, 0.25, -3.0, 1.0, 0.0, 4.0], atol=1e-6)


def test_presence_and_frequency_penalties_output_only():
    # context has 0 and 1 (prompt) but they are not output tokens: untouched
    got = _pen([0, 1, 2, 2, 4], [2, 2, 4], presence_penalty=0.5, frequency_penalty=0.25)
    # 2: 0.5 - (0.5 + 2*0.25) = -0.5 ; 4: 1.0 - (0.5 + 1*0.25) = 0.25
    want = [2.0, -1.0, -0.5, -3.0, 0.25, 0.0, 4.0]
    np.testing.assert_allclose(got, want, atol=1e-6)
    # negative penalties encourage
    got = _pen([], [6, 6, 6], presence_penalty=-1.0, frequency_penalty=-0.5)
    np.testing.assert_allclose(got, BASE[:6] + [4.0 + 1.0 + 1.5], atol=1e-6)


def test_all_penalties_combined():
    got = _pen([1, 4, 6, 4], [4, 6, 4], repetition_penalty=2.0, presence_penalty=0.1, frequency_penalty=0.2)
    # repetition first: 1 -> -2, 4 -> 0.5, 6 -> 2 ; then 4: -(0.1+0.4), 6: -(0.1+0.2)
    want = [2.0, -2.0, 0.5, -3.0, 0.5 - 0.5, 0.0, 2.0 - 0.3]
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_no_penalties_is_identity():
    assert _pen([0, 1, 2], [2]) == BASE


def test_greedy_is_argmax_after_penalties():
    logits = torch.tensor(BASE)
    p = SamplingParams(temperature=0.0)
    assert sample(logits, [], [], p, None) == 6
    # repetition penalty 3 on token 6 -> 4/3 < 2.0 -> token 0 wins
    p = SamplingParams(temperature=0.0, repetition_penalty=3.0)
    assert sample(logits, [5, 6], [6], p, None) == 0
    assert logits.tolist() == BASE  # sample() never modifies the caller's logits
    assert make_generator(p, torch.device("cpu")) is None


# --- the draw -------------------------------------------------------------------------------

# Pearson chi-square with 3 degrees of freedom: P(X > 45) = erfc(sqrt(22.5)) +
# sqrt(90/pi) exp(-22.5) ~ 9e-10, so a correct sampler fails this bound with probability
# ~1e-9 (and the seed is fixed, so the outcome is deterministic anyway).
CHI2_DF3_BOUND = 45.0


def _chi2_sf_df3(x: float) -> float:
    return math.erfc(math.sqrt(x / 2)) + math.sqrt(2 * x / math.pi) * math.exp(-x / 2)


def _draw_counts(logits, params, n, seed):
    g = torch.Generator()
    g.manual_seed(seed)
    counts = np.zeros(len(logits), dtype=np.int64)
    t = torch.tensor(logits)
    for _ in range(n):
        counts[sample(t, [], [], params, g)] += 1
    return counts


@pytest.mark.parametrize(
    "logits, params",
    [
        ([math.log(x) for x in (0.1, 0.2, 0.3, 0.4)], SamplingParams(temperature=1.0)),
        # 5 tokens, temperature 0.7 and top-k 4: token 4 has probability 0 after the filter
        ([0.3, -0.4, 1.2, 0.8, -2.0], SamplingParams(temperature=0.7, top_k=4)),
    ],
)
def test_sampling_frequencies_chi_square(logits, params):
    assert _chi2_sf_df3(CHI2_DF3_BOUND) < 1e-9
    n = 20_000
    probs = ref_probs(logits, params.temperature, params.top_k)
    counts = _draw_counts(logits, params, n, seed=20240611)
    support = probs > 0
    assert support.sum() == 4  # df = 3
    assert counts[~support].sum() == 0  # filtered tokens are never drawn
    expected = n * probs[support]
    chi2 = float((((counts[support] - expected) ** 2) / expected).sum())
    assert chi2 < CHI2_DF3_BOUND, (counts, expected, chi2)


def test_chi_square_catches_a_wrong_distribution():
    """The bound above has teeth: the same counts tested against a slightly different
    distribution (0.12, 0.18, 0.3, 0.4) fail it."""
    logits = [math.log(x) for x in (0.1, 0.2, 0.3, 0.4)]
    counts = _draw_counts(logits, SamplingParams(temperature=1.0), 20_000, seed=20240611)
    wrong = 20_000 * np.array([0.12, 0.18, 0.3, 0.4])
    assert float((((counts - wrong) ** 2) / wrong).sum()) > CHI2_DF3_BOUND


def test_generator_seed_reproduces_draws():
    p = SamplingParams(temperature=1.0, seed=99)
    t = torch.tensor([0.0, 0.1, 0.2, 0.3, 0.4, 0.5])
    g1, g2 = make_generator(p, torch.device("cpu")), make_generator(p, torch.device("cpu"))
    a = [sample(t, [], [], p, g1) for _ in range(50)]
    b = [sample(t, [], [], p, g2) for _ in range(50)]
    assert a == b and len(set(a)) > 1


# --- stop strings ---------------------------------------------------------------------------


def test_stop_string_split_across_feeds():
    m = StopStringMatcher(["<|end|>"])
    assert m.feed("Hello <|") == ("Hello ", False)
    assert m.feed("en") == ("", False)
    assert m.feed("d|> and more") == ("", True)


def test_stop_string_non_matching_prefix_released():
    m = StopStringMatcher(["<|end|>"])
    assert m.feed("a <|e") == ("a ", False)
    assert m.feed("x") == ("<|ex", False)  # can no longer match: released
    assert m.feed("<") == ("", False)
    assert m.feed("<|end") == ("<", False)  # the first "<" cannot start a match any more
    assert m.flush() == "<|end"  # generation ended without the stop: hand back the rest


def test_multiple_stop_strings_earliest_wins():
    for stops in (["world", "lo w"], ["lo w", "world"]):
        m = StopStringMatcher(stops)
        assert m.feed("hello world") == ("hel", True)
    m = StopStringMatcher(["abc", "bcd"])
    assert m.feed("xab") == ("x", False)
    assert m.feed("cd") == ("", True)  # "abc" at 0 beats "bcd" at 1
    m = StopStringMatcher(["zz", "y"])
    assert m.feed("az") == ("a", False)
    assert m.feed("yzz") == ("z", True)  # "y" completes before "zz" starts


def test_no_stop_strings_pass_through():
    m = StopStringMatcher([])
    assert m.feed("<|") == ("<|", False)
    assert m.flush() == ""


def _reference_stop_run(chunks, stops):
    """Brute force over the whole text received so far: after each chunk, either a stop
    string occurs (final text = everything before its earliest occurrence) or the safe
    text is everything except the longest suffix that is a proper prefix of a stop."""
    received = ""
    safe_after = []
    for chunk in chunks:
        received += chunk
        hits = [received.find(s) for s in stops if s in received]
        if hits:
            safe_after.append(received[: min(hits)])
            return safe_after, True
        hold = 0
        for j in range(len(received)):
            tail = received[j:]
            if any(len(tail) < len(s) and s.startswith(tail) for s in stops):
                hold = len(tail)
                break
        safe_after.append(received[: len(received) - hold])
    return safe_after, False


def test_stop_strings_random_against_brute_force():
    rng = random.Random(1234)
    alphabet = "ab<|>"
    for _ in range(2000):
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 16)))
        chunks, i = [], 0
        while i < len(text):
            n = rng.randint(1, 4)
            chunks.append(text[i : i + n])
            i += n
        want, want_hit = _reference_stop_run(chunks, stops)
        m = StopStringMatcher(stops)
        emitted, hit = "", False
        for k, chunk in enumerate(chunks):
            out, hit = m.feed(chunk)
            emitted += out
            assert emitted == want[k], (stops, chunks, k)
            if hit:
                break
        assert hit == want_hit
        if not want_hit:
            assert emitted + m.flush() == text


# --- end to end on smollm2 ------------------------------------------------------------------

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def llms(smollm2_path):
    """The two model loads of this module: default context and max_model_len=16.

    Batch-invariant: the tests below compare runs of one prompt token for token (a stop
    against the full run, the short-context engine against the default one, a chat that
    repeats one whose pages the prefix cache now holds). In the default mode those runs
    may take different kernels (a prefix-cache hit prefills only the rest of the prompt;
    pages left non-consecutive by earlier requests are attended run by run), and a
    near-tie could flip on some CPUs; in this mode bit-identity is the contract."""
    return (LLM(str(smollm2_path), progress=False, batch_invariant=True),
            LLM(str(smollm2_path), progress=False, max_model_len=16, batch_invariant=True))


@pytest.fixture(scope="module")
def llm(llms):
    return llms[0]


@pytest.fixture(scope="module")
def greedy_ref(llm):
    """The model's own greedy continuation of PROMPT (24 tokens), computed once."""
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=24))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 24, "EOS inside the reference; pick another prompt"
    return out


def test_max_tokens_gives_length(llm, greedy_ref):
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=5))[0]
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 5 and out.metrics.output_tokens == 5
    assert out.token_ids == greedy_ref.token_ids[:5]  # greedy is a deterministic prefix
    assert out.prompt_token_ids == llm.tokenizer.encode(PROMPT)


def test_stop_string_truncates_right_before_it(llm, greedy_ref):
    text = greedy_ref.text
    mid = len(text) // 2
    stop = text[mid : mid + 5]
    assert stop.strip(), text
    cut = text.find(stop)  # the first occurrence is where generation must stop
    events = list(llm.stream(PROMPT, SamplingParams(temperature=0.0, max_tokens=24, stop=[stop])))
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=24, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:cut]
    assert stop not in out.text
    assert out.token_ids == greedy_ref.token_ids[: len(out.token_ids)]
    assert len(out.token_ids) < 24
    # streaming: the event texts concatenate to the final text; only the last is finished
    assert "".join(e.text for e in events) == out.text
    assert [e.token_id for e in events] == out.token_ids
    assert [e.finished for e in events] == [False] * (len(events) - 1) + [True]
    assert events[-1].finish_reason == "stop"


def test_stream_concatenates_to_text_without_stop(llm, greedy_ref):
    events = list(llm.stream(PROMPT, SamplingParams(temperature=0.0, max_tokens=24)))
    assert "".join(e.text for e in events) == greedy_ref.text
    assert [e.token_id for e in events] == greedy_ref.token_ids
    assert events[-1].finished and events[-1].finish_reason == "length"


def test_stop_token_ids(llm, greedy_ref):
    third = greedy_ref.token_ids[2]
    assert third not in greedy_ref.token_ids[:2]
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[third]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == greedy_ref.token_ids[:3]
    assert out.text == llm.tokenizer.decode(greedy_ref.token_ids[:2])


def test_chat_ends_on_eos_and_ignore_eos(llm):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=200))
    im_end = llm.tokenizer.encode("<|im_end|>")
    assert len(im_end) == 1, im_end
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] == im_end[0]
    assert len(out.token_ids) < 200
    assert "<|im_end|>" not in out.text and out.text.strip()
    # ignore_eos: the same greedy run continues through the EOS to max_tokens
    n = len(out.token_ids)
    more = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=n + 3, ignore_eos=True))
    assert more.finish_reason == "length"
    assert len(more.token_ids) == n + 3
    assert more.token_ids[:n] == out.token_ids


def test_seed_reproducible_across_other_requests(llm):
    p = SamplingParams(temperature=0.8, max_tokens=16, seed=123)
    a = llm.generate(PROMPT, p)[0]
    b = llm.generate(PROMPT, SamplingParams(temperature=0.8, max_tokens=16, seed=7))[0]
    c = llm.generate(PROMPT, p)[0]
    assert len(a.token_ids) == 16 or a.finish_reason == "stop"
    assert a.token_ids == c.token_ids and a.text == c.text
    assert b.token_ids != a.token_ids  # P(16 equal draws at T=0.8) is negligible


def test_bad_requests_do_not_break_the_engine(llms, greedy_ref):
    llm, short = llms
    good = SamplingParams(temperature=0.0, max_tokens=6)
    vocab = llm.config.vocab_size
    with pytest.raises(ConfigError) as exc:
        llm.generate([1, 2, vocab], good)
    assert exc.value.field == "prompt_token_ids" and "prompt_token_ids" in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        llm.generate([[5, -1]], good)
    assert exc.value.field == "prompt_token_ids"
    with pytest.raises(ConfigError):
        llm.generate("", good)
    with pytest.raises(ConfigError):
        llm.generate([[]], good)
    with pytest.raises(ConfigError):
        list(llm.stream([], good))
    assert llm.generate(PROMPT, good)[0].token_ids == greedy_ref.token_ids[:6]

    ids = llm.tokenizer.encode(" ".join(["one two three four five six seven eight nine ten"] * 3))
    assert len(ids) > 16
    with pytest.raises(ConfigError, match="max_model_len"):
        short.generate(ids[:16], good)  # 16 prompt tokens leave no room in a 16-token context
    with pytest.raises(ConfigError, match="max_model_len"):
        short.generate(ids, good)
    # 15 prompt tokens: exactly one token fits, then "length"
    edge = short.generate(ids[:15], good)[0]
    assert edge.finish_reason == "length" and len(edge.token_ids) == 1
    # and the short-context engine still works, matching the default one token for token
    out = short.generate(PROMPT, good)[0]
    assert out.token_ids == greedy_ref.token_ids[:6] and out.finish_reason == "length"
    with pytest.raises(ConfigError, match="max_model_len"):
        LLM(str(llm.model_path), progress=False, max_model_len=1)


def test_extreme_but_valid_settings_still_give_a_distribution():
    """Found by schema fuzzing: repetition_penalty=5e-324 overflowed the penalised logits to
    inf and the softmax to NaN; a tiny temperature did the same. Both must still sample,
    and a vanishing temperature must pick the argmax as greedy does."""
    logits = torch.tensor([1.0, 3.0, -2.0, 0.5, 2.9])
    for temperature in (1e-30, 1e-44, 5e-324):  # normal, denormal and zero in float32
        tiny = SamplingParams(temperature=temperature, seed=1)
        probs = filtered_probs(logits.clone(), tiny)
        assert torch.isfinite(probs).all() and probs[1] == 1.0, temperature
    extreme = SamplingParams(temperature=1.0, repetition_penalty=5e-324, seed=2)
    penalized = apply_penalties(logits.clone(), [0, 1, 2], [], extreme)
    assert torch.isfinite(penalized).all()
    # a penalty below 1 favours seen tokens: positive seen logits become huge, the negative one tiny
    assert penalized[1] == penalized[0] == torch.finfo(torch.float32).max and penalized[2] > -1e-30
    probs = filtered_probs(penalized, extreme)
    assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1) < 1e-6
    token = sample(logits.clone(), [0, 1, 2], [], extreme, make_generator(extreme, logits.device))
    assert token in (0, 1)
    # top_p = 5e-324 is 0 in float32: only the most likely token may remain, never none
    probs = filtered_probs(logits.clone(), SamplingParams(temperature=1.0, top_p=5e-324, seed=3))
    assert probs.tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]
