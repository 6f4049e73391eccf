"""The constrained draw that checks candidate tokens before (or instead of) computing a
mask, or takes the token the grammar forces without one, gives the masked draw's token:
checked against llguidance's own mask token by token and at every forced position,
against the masked argmax on crafted logits (ties included) with a step's rows drawn
together, against the exact masked distribution for temperature sampling (a chi-square
test), and end to end against the engine with the check turned off."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from minivllm.engine.llm import LLM
from minivllm.gguf.reader import GGUFFile
from minivllm.gguf.tokenizer import Tokenizer
from minivllm.sampling import constrained_draw, step_draw
from minivllm.sampling import constraint as constraint_module
from minivllm.sampling.constraint import Constraints, allowed_tokens, new_bitmask
from minivllm.sampling.sampler import make_generator, sample
from minivllm.sampling.sampling_params import SamplingParams
from minivllm.sampling.step_draw import draw_step
from minivllm.sampling.structured import StructuredOutput

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RECORDS = {
    "type": "object",
    "properties": {"items": {"type": "array", "minItems": 3, "items": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                       "name": {"type": "string", "minLength": 1, "maxLength": 12}},
        "required": ["id", "name"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False,
}
RECORDS_TEXT = json.dumps({"items": [{"id": 7, "name": "teapot"}, {"id": 864, "name": "ñandú zz"},
                                     {"id": 12, "name": "abcdefghijkl"}]}, separators=(",", ":"), ensure_ascii=False)
SENTENCE = 'start: "(" expr ")"\nexpr: /[0-9]+/ | expr "+" expr | "(" expr ")"'
TRACES = [  # (constraint, an output it allows)
    ({"json_schema": RECORDS}, RECORDS_TEXT),
    ({"regex": r"[a-z]{1,3}( ok)?"}, "ab ok"),
    ({"choice": ["yes", "no", "maybe so"]}, "maybe so"),
    ({"grammar": SENTENCE}, "(12+(3+4)+567)"),
    ({"json_object": True}, '{"a":[1,2.5,"x y"],"b":{"c":null}}'),
]


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path):
    return Tokenizer.from_gguf(GGUFFile(smollm2_path))


@pytest.fixture(scope="module")
def qwen_tokenizer(qwen05_path):
    return Tokenizer.from_gguf(GGUFFile(qwen05_path))


def _mask_bits(constraint, vocab: int) -> np.ndarray:
    bitmask = new_bitmask(1, vocab)
    constraint.fill(bitmask, 0)
    return allowed_tokens(bitmask, vocab, torch.device("cpu"))[0].numpy()


def _states(tokenizer, vocab: int, structured: dict, text: str):
    """The constraint at each position of `text`'s tokens, and the token that follows."""
    constraints = Constraints(tokenizer, vocab)
    constraint = constraints.make(StructuredOutput(**structured))
    ids = tokenizer.encode(text, add_bos=False)
    for token in ids + [None]:
        yield constraints, constraint, token
        if token is None:
            return
        constraint.advance(token)


@pytest.mark.parametrize("tokenizer_name,padding", [("smollm2_tokenizer", 64), ("qwen_tokenizer", 0)])
def test_allows_agrees_with_the_mask_token_by_token(tokenizer_name, padding, request):
    """Wherever `checks_tokens()` says the check stands in for the mask, `allows(t)` is
    the mask's bit for every id of the vocabulary: text tokens, control tokens, the end
    of sequence once the output is complete, and padding rows past the tokenizer."""
    tokenizer = request.getfixturevalue(tokenizer_name)
    vocab = tokenizer.vocab_size + padding
    traces = TRACES if padding else TRACES[:1]
    checked = forced = 0
    for structured, text in traces:
        for _, constraint, _ in _states(tokenizer, vocab, structured, text):
            bits = _mask_bits(constraint, vocab)
            if not constraint.checks_tokens():
                forced += 1
                continue
            answers = np.array([constraint.allows(t) for t in range(vocab)])
            wrong = np.nonzero(answers != bits)[0]
            assert wrong.size == 0, (structured, [(int(t), tokenizer.token_bytes(int(t)) if t < tokenizer.vocab_size
                                                   else b"<pad>", bool(bits[t])) for t in wrong[:8]])
            checked += 1
    assert checked >= 10 and forced >= 3, (checked, forced)  # both kinds of position were met


@pytest.mark.parametrize("tokenizer_name,padding", [("smollm2_tokenizer", 64), ("qwen_tokenizer", 0)])
def test_a_forced_token_is_the_only_one_the_mask_allows(tokenizer_name, padding, request):
    """Where `forced_token()` names a token, llguidance's mask allows that token and no
    other, so the draw can take it without the mask (`draws_forced`); everywhere else the
    mask allows more than one, or `forced_token()` would have been free to say so."""
    tokenizer = request.getfixturevalue(tokenizer_name)
    vocab = tokenizer.vocab_size + padding
    forced = free = 0
    for structured, text in TRACES:
        for _, constraint, _ in _states(tokenizer, vocab, structured, text):
            allowed = np.nonzero(_mask_bits(constraint, vocab))[0].tolist()
            token = constraint.forced_token()
            if token is None:
                free += 1
                continue
            assert allowed == [token], (structured, token, allowed[:8], len(allowed))
            forced += 1
    assert forced >= 8 and free >= 20, (forced, free)


def test_forced_rows_never_read_their_logits(smollm2_tokenizer):
    """A step whose constrained rows are all at forced positions draws with no device
    work: their logits rows live on torch's meta device here, where reading a value fails.
    A row that needs a mask or an argmax would raise instead of drawing."""
    tokenizer = smollm2_tokenizer
    constraints = Constraints(tokenizer, tokenizer.vocab_size)
    rows = []
    # Constraints whose first token is forced, drawn greedy, sampled, and sampled with top-k.
    forcing = [{"json_schema": RECORDS}, {"regex": "hello [0-9]+"}, {"grammar": 'start: "SELECT " ("id" | "name")'},
               {"choice": ["maybe so", "maybe not"]}]
    for k, structured in enumerate(forcing):
        constraint = constraints.make(StructuredOutput(**structured))
        assert constraint.forced_token() is not None, structured
        params = SamplingParams(temperature=0.0 if k % 2 else 0.8, seed=k, top_k=5 * (k % 3))
        rows.append((_request(constraint, params, rid=f"r{k}", generator=make_generator(params, torch.device("cpu"))),
                     torch.empty(tokenizer.vocab_size, device="meta")))
    drawn = draw_step(rows, constraints.early_masks(rows, device_busy=True), constraints, want_masked=False)
    assert {rid: d.token for rid, d in drawn.items()} == {req.id: req.constraint.forced_token() for req, _ in rows}
    assert constraints.counts["forced"] == len(rows)


@pytest.mark.parametrize("tokenizer_name", ["smollm2_tokenizer", "qwen_tokenizer"])
def test_narrow_positions_have_small_masks(tokenizer_name, request):
    """`looks_narrow` (which greedy rows get their mask beside a GPU's forward) is only a
    guess about cost, but one that must hold where it matters: every mask allowing a
    tenth of the vocabulary or more (inside strings: the expensive ones, where a check
    finds a token) is judged wide, and a position judged narrow allows under 1% of it."""
    tokenizer = request.getfixturevalue(tokenizer_name)
    vocab = tokenizer.vocab_size
    seen = {"narrow": 0, "wide": 0}
    for structured, text in TRACES:
        for _, constraint, _ in _states(tokenizer, vocab, structured, text):
            allowed = int(_mask_bits(constraint, vocab).sum())
            narrow = constraint.looks_narrow()
            seen["narrow" if narrow else "wide"] += 1
            assert not (allowed >= vocab / 10 and narrow), (structured, allowed)
            assert not (narrow and allowed >= vocab / 100), (structured, allowed)
    assert seen["narrow"] >= 20 and seen["wide"] >= 10, seen


def _request(constraint, params: SamplingParams, output_ids=(), generator=None, rid="r"):
    return SimpleNamespace(id=rid, constraint=constraint, params=params, all_ids=list(output_ids),
                           output_ids=list(output_ids), generator=generator)


def _draw(constraints, req, logits) -> int:
    """One row drawn alone, as the engine draws a follower's first token."""
    drawn = draw_step([(req, logits)], {}, constraints, want_masked=False)[req.id]
    if isinstance(drawn, Exception):
        raise drawn
    return drawn.token


def _topk_ties_highest_id_first(topk):
    """A legal torch.topk that breaks ties the other way from CPU's (lowest id first): the
    draw must not rely on either."""
    def one_row(x, k):
        values, ids = topk(x, min(x.shape[-1], k + 400))
        order = sorted(range(len(ids)), key=lambda j: (-float(values[j]), -int(ids[j])))[:k]
        return values[order], ids[order]

    def adversarial(x, k, dim=-1, *args, **kwargs):
        rows = [one_row(r, k) for r in (x if x.dim() == 2 else x[None])]
        values, ids = torch.stack([v for v, _ in rows]), torch.stack([i for _, i in rows])
        return torch.return_types.topk((values, ids) if x.dim() == 2 else (values[0], ids[0]))
    return adversarial


@pytest.mark.parametrize("ties,busy", [("cpu", False), ("highest_id_first", False), ("cpu", True),
                                       ("highest_id_first", True)])
def test_greedy_draw_equals_the_masked_argmax_ties_and_penalties_included(smollm2_tokenizer, ties, busy, monkeypatch):
    """At every position of every trace, a step of rows drawn together (step_draw): six
    constrained rows on crafted logits (tied maxima, penalties), one whose mask is already
    computed, and an unconstrained one; with `busy`, the draw as a GPU runs it: the masks
    `early_masks` computes beside the forward (the narrow positions'), and the checked
    rows' top-k queued with the argmax over every greedy row. Each token must be the
    argmax of its own row, masked by llguidance and penalised, computed row by row here."""
    if ties == "highest_id_first":
        monkeypatch.setattr(torch, "topk", _topk_ties_highest_id_first(torch.topk))
    if busy:
        monkeypatch.setattr(step_draw, "queues_candidates", lambda logits: True)
    # Checks cost nothing here: every candidate is tried before a mask, so their order counts.
    monkeypatch.setattr(constrained_draw, "CHECK_COST_S", 1e-12)
    tokenizer = smollm2_tokenizer
    vocab = tokenizer.vocab_size
    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    compared = 0
    for structured, text in TRACES:
        for constraints, constraint, _ in _states(tokenizer, vocab, structured, text):
            allowed = np.nonzero(_mask_bits(constraint, vocab))[0]
            rows, expected, masks = [], {}, {}
            for trial in range(8):
                logits = torch.randn(vocab, generator=gen) * 3
                if trial % 2:
                    # A block of tied maxima, allowed and forbidden ids mixed: the lowest
                    # allowed id must win. Many more than the candidates the draw looks at
                    # (the tied cut-off), or a few inside them (ties ordered by id).
                    few = trial == 3
                    forbidden = np.setdiff1d(np.arange(vocab), allowed)
                    picks = np.concatenate([rng.choice(allowed, min(3 if few else 60, len(allowed)), replace=False),
                                            rng.choice(forbidden, 3 if few else 200, replace=False)])
                    logits[torch.as_tensor(picks)] = 20.0
                params = SamplingParams(temperature=0, repetition_penalty=1.3 if trial >= 4 else 1.0)
                plain = trial == 7
                req = _request(None if plain else constraint, params, rid=f"t{trial}",
                               output_ids=allowed[:2].tolist() if trial >= 4 else ())
                reference = logits if plain else constraints.mask_now(constraint, logits)
                expected[req.id] = sample(reference, req.all_ids, req.output_ids, params, None)
                if trial == 6:
                    masks[req.id] = constraints.fill_masks([constraint])[0][0]  # computed beside the forward
                rows.append((req, logits))
            if busy:
                masks = {**constraints.early_masks(rows, device_busy=True), **masks}
            drawn = draw_step(rows, masks, constraints, want_masked=False)
            assert {rid: d.token for rid, d in drawn.items()} == expected, structured
            compared += len(rows)
    assert compared > 400


@pytest.mark.parametrize("top_k", [0, 4], ids=["temperature", "top_k"])
def test_sampling_draws_from_the_exact_masked_distribution(smollm2_tokenizer, top_k):
    """Temperature only: rejection sampling from the unmasked distribution, then a masked
    draw when no candidate fits; the logits put a fifth of the mass on allowed tokens, so
    both ways are taken. Top-k: the mask first (the unmasked top 4 would hold the two
    likeliest forbidden tokens and leave out the third allowed one). Either way the tokens
    must follow softmax(logits) restricted to the allowed set, then filtered."""
    tokenizer = smollm2_tokenizer
    vocab = tokenizer.vocab_size
    constraints = Constraints(tokenizer, vocab)
    constraint = constraints.make(StructuredOutput(regex="[a-c]"))
    allowed = np.nonzero(_mask_bits(constraint, vocab))[0]
    assert 3 <= len(allowed) <= 8, [tokenizer.token_bytes(int(t)) for t in allowed]
    logits = torch.full((vocab,), -30.0)
    allowed_logits = torch.log(torch.tensor([0.5, 0.3, 0.2] + [0.0] * (len(allowed) - 3)) + 1e-30)
    logits[torch.as_tensor(allowed)] = allowed_logits + float(np.log(0.2))
    forbidden = [t for t in range(100, 110) if t not in set(allowed.tolist())][:2]
    logits[forbidden] = float(np.log(0.4))
    exact = torch.softmax(logits, -1)[torch.as_tensor(allowed)]
    exact = (exact / exact.sum()).numpy()
    params = SamplingParams(temperature=1.0, seed=1234, top_k=top_k)
    req = _request(constraint, params, generator=make_generator(params, torch.device("cpu")))
    counts = np.zeros(len(allowed))
    n = 6000

    index = {int(t): k for k, t in enumerate(allowed)}
    for _ in range(n):
        counts[index[_draw(constraints, req, logits)]] += 1
    fallbacks = constraints.counts["masked_at_draw"]
    present = exact > 1e-9
    chi2 = float((((counts - n * exact) ** 2)[present] / (n * exact)[present]).sum())
    assert counts[~present].sum() == 0
    assert chi2 < 20.0, (chi2, counts, exact * n)  # 2 degrees of freedom: p < 5e-5 to fail by chance
    if top_k:
        assert fallbacks == n
    else:  # 0.8^8 of draws find no allowed candidate among 8
        assert 0.1 * n < fallbacks < 0.25 * n, fallbacks


def test_the_engine_gives_the_same_greedy_tokens_with_the_shortcuts_off(qwen05_path, monkeypatch):
    """End to end on Qwen2.5-Coder (152k vocabulary) with length-bounded strings, where the
    check replaces most masks and the grammar forces the keys: the same tokens as masking
    every row before its draw."""
    llm = LLM(str(qwen05_path), max_model_len=512, progress=False)
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": f"List {k} products as JSON."}])
               for k in ("three", "four")]
    params = SamplingParams(temperature=0, max_tokens=48, structured={"json_schema": RECORDS})
    before = dict(llm.engine.constraints.counts)
    shortcut = [o.token_ids for o in llm.generate(prompts, [params] * 2)]
    counts = {k: v - before[k] for k, v in llm.engine.constraints.counts.items()}
    assert counts["checked"] > 10 and counts["forced"] > 10, counts  # both shortcuts were taken
    monkeypatch.setattr(step_draw, "checks_candidates", lambda p: False)
    monkeypatch.setattr(step_draw, "draws_forced", lambda req, wanted=False: False)
    monkeypatch.setattr(constraint_module, "draws_forced", lambda req, wanted=False: False)
    masked_first = [o.token_ids for o in llm.generate(prompts, [params] * 2)]
    assert shortcut == masked_first
