"""Structured output in the engine, on real models: every output under a JSON schema
validates with `jsonschema`, regex outputs match with `re`, a Lark grammar's outputs parse
with the `lark` package (references independent of llguidance), and the mask itself is
checked exactly against a vocabulary scan."""

from __future__ import annotations

import json
import re

import jsonschema
import lark
import pytest
from synthetic_gguf import write_tiny_model

from minivllm.engine.llm import LLM
from minivllm.errors import ConfigError
from minivllm.sampling.sampling_params import SamplingParams
from minivllm.sampling.structured import StructuredOutput

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "editor", "viewer"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
TAGS = {
    "type": "object",
    "properties": {"tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                            "minItems": 1, "maxItems": 3},
                   "score": {"type": "number", "minimum": 0, "maximum": 1}},
    "required": ["tags", "score"],
    "additionalProperties": False,
}
# [0-9], not \d: llguidance's \d is Unicode's (as Python's is), and a model asked for a
# phone number may well write U+1FBF8 SEGMENTED DIGIT EIGHT.
REGEXES = [r"[0-9]{3}-[0-9]{4}", r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])", r"[a-z]{3,8}@[a-z]{3,8}\.(com|org)"]
SENTENCE = r"""
start: subject " " verb " " count " " noun "."
subject: "the cat" | "a dog" | "my friend"
verb: "sees" | "likes" | "chases"
count: /[1-9][0-9]?/
noun: "apples" | "birds" | "cars"
"""


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return LLM(str(smollm2_path), max_model_len=512, progress=False)


@pytest.fixture(scope="module")
def qwen(qwen05_path):
    return LLM(str(qwen05_path), max_model_len=512, progress=False)


def _chat(llm, text: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def _variants(structured, max_tokens: int, n_sampled: int) -> list[SamplingParams]:
    """Greedy, then sampled with seeds (temperature 1: the model's own distribution)."""
    return ([SamplingParams(temperature=0, max_tokens=max_tokens, structured=structured)]
            + [SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens, structured=structured)
               for s in range(n_sampled)])


def _assert_pages_free(llm) -> None:
    engine = llm.engine
    assert engine.kv_ownership()["requests"] == {}
    engine.clear_prefix_cache()
    assert engine.pool.num_free == engine.pool.num_pages


@pytest.mark.parametrize("model", ["smollm2", "qwen"])
@pytest.mark.parametrize("schema", [PERSON, TAGS], ids=["person", "tags"])
def test_every_output_under_a_json_schema_validates(model, schema, request):
    llm = request.getfixturevalue(model)
    prompt = _chat(llm, "Give one example record as JSON.")
    params = _variants({"json_schema": schema}, max_tokens=80, n_sampled=5)
    outputs = llm.generate([prompt] * len(params), params)
    for out in outputs:
        assert out.finish_reason == "stop", (out.finish_reason, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    _assert_pages_free(llm)


@pytest.mark.parametrize("model", ["smollm2", "qwen"])
def test_regex_outputs_match_their_regex(model, request):
    llm = request.getfixturevalue(model)
    prompt = _chat(llm, "Write a phone number, a date or an email address.")
    prompts, params = [], []
    for rx in REGEXES:
        for p in _variants({"regex": rx}, max_tokens=30, n_sampled=3):
            prompts.append(prompt)
            params.append(p)
    for out, p in zip(llm.generate(prompts, params), params):
        assert out.finish_reason == "stop", (out.finish_reason, out.text)
        assert re.fullmatch(p.structured.regex, out.text), (p.structured.regex, out.text)


def test_choice_and_json_object(smollm2):
    prompt = _chat(smollm2, "Is the sky green? Answer yes, no or maybe.")
    choices = ["yes", "no", "maybe"]
    outs = smollm2.generate([prompt] * 4, _variants({"choice": choices}, max_tokens=10, n_sampled=3))
    assert all(o.text in choices and o.finish_reason == "stop" for o in outs), [o.text for o in outs]
    outs = smollm2.generate([_chat(smollm2, "Describe a city as JSON.")] * 3,
                            _variants({"json_object": True}, max_tokens=120, n_sampled=2))
    for out in outs:
        if out.finish_reason == "stop":  # an open-ended object may run to max_tokens
            assert isinstance(json.loads(out.text), dict), out.text
        else:
            assert out.finish_reason == "length" and out.text.startswith("{"), out.text


def test_a_lark_grammar_holds_over_50_sampled_outputs(smollm2):
    parser = lark.Lark(SENTENCE)
    prompt = _chat(smollm2, "Write a short sentence about an animal.")
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=40, structured={"grammar": SENTENCE})
              for s in range(50)]
    outs = smollm2.generate([prompt] * 50, params)
    for out in outs:
        assert out.finish_reason == "stop", (out.finish_reason, out.text)
        parser.parse(out.text)  # raises on any output outside the grammar
    assert len({o.text for o in outs}) > 5  # sampled, not one forced string
    _assert_pages_free(smollm2)


def test_the_mask_is_exactly_the_tokens_that_can_start_a_choice(smollm2):
    """The constrained row equals the raw row on allowed tokens and is -inf elsewhere,
    where "allowed" comes from scanning the vocabulary: a token may come first if its
    bytes are a non-empty prefix of one of the choices."""
    choices = [b"yes", b"no", b"maybe"]
    tok = smollm2.tokenizer
    expected = {t for t in range(tok.vocab_size) if not tok.is_special(t)
                and (piece := tok.token_bytes(t)) and any(c.startswith(piece) for c in choices)}
    rows = {}
    smollm2.engine.logits_hook = lambda rid, logits: rows.setdefault(rid, logits.float().clone())
    try:
        prompt = _chat(smollm2, "Yes or no?")
        smollm2.engine.add_request(tok.encode(prompt), SamplingParams(temperature=0, max_tokens=1), request_id="raw")
        smollm2.engine.add_request(tok.encode(prompt), SamplingParams(
            temperature=0, max_tokens=1, structured={"choice": [c.decode() for c in choices]}), request_id="masked")
        list(smollm2.engine.run())
    finally:
        smollm2.engine.logits_hook = None
        for rid in ("raw", "masked"):
            smollm2.engine.release(rid)
    raw, masked = rows["raw"], rows["masked"]
    allowed = {int(t) for t in (masked != float("-inf")).nonzero().flatten()}
    assert allowed == expected
    idx = sorted(expected)
    assert masked[idx].tolist() == raw[idx].tolist()


def test_speculative_decoding_keeps_the_constraint_and_stays_lossless(smollm2_path, smollm2):
    spec = LLM(str(smollm2_path), max_model_len=512, progress=False, draft_model=str(smollm2_path),
               num_draft_tokens=4)
    prompt = _chat(smollm2, "Give one example record as JSON.")
    greedy = SamplingParams(temperature=0, max_tokens=80, structured={"json_schema": PERSON})
    assert spec.generate(prompt, greedy)[0].text == smollm2.generate(prompt, greedy)[0].text
    params = _variants({"json_schema": PERSON}, max_tokens=80, n_sampled=4)[1:]
    outs = spec.generate([prompt] * len(params), params)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)
    # The draft is unconstrained: it proposes tokens the mask forbids, which must be rejected.
    proposed = sum(o.metrics.speculation["proposed"] for o in outs)
    accepted = sum(o.metrics.speculation["accepted"] for o in outs)
    assert 0 < accepted < proposed, (accepted, proposed)
    _assert_pages_free(spec)


def test_identical_prompts_with_different_constraints_share_a_flight(smollm2):
    """Single-flight followers sample their first token from the leader's prompt logits:
    each must apply its own constraint to them, not the leader's."""
    prompt = _chat(smollm2, "Write a phone number or say hello.")
    plain = SamplingParams(temperature=0, max_tokens=12)
    alone = smollm2.generate(prompt, plain)[0].text
    smollm2.engine.clear_prefix_cache()
    outs = smollm2.generate([prompt] * 3, [
        SamplingParams(temperature=0, max_tokens=20, structured={"regex": REGEXES[0]}),
        plain,
        SamplingParams(temperature=0, max_tokens=20, structured={"choice": ["hello", "bye"]})])
    assert re.fullmatch(REGEXES[0], outs[0].text), outs[0].text
    assert outs[1].text == alone
    assert outs[2].text in ("hello", "bye")
    # And from the prefix cache, a second time.
    again = smollm2.generate(prompt, SamplingParams(temperature=0, max_tokens=20, structured={"regex": REGEXES[0]}))
    assert again[0].text == outs[0].text
    _assert_pages_free(smollm2)


def test_a_constraint_the_vocabulary_cannot_spell_ends_with_an_error(tmp_path):
    """A model whose vocabulary has no digits cannot write `[0-9]+`: that request ends with
    an error at its first token; its batch-mate is untouched and no page stays held."""
    from synthetic_gguf import tiny_vocab

    tokens, _, _ = tiny_vocab(512)
    from minivllm.gguf.tokenizer import _byte_level_bytes

    no_digits = {i: 5 for i, t in enumerate(tokens[:-3]) if any(chr(b).isdigit() for b in _byte_level_bytes(t))}
    path = write_tiny_model(tmp_path / "nodigits.gguf", token_type_overrides=no_digits)
    llm = LLM(str(path), max_model_len=128, progress=False)
    engine, ids = llm.engine, llm.tokenizer.encode("abc")
    engine.add_request(ids, SamplingParams(temperature=0, max_tokens=8, structured={"regex": "[0-9]+"}),
                       request_id="digits")
    engine.add_request(ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), request_id="plain")
    finished = {e.request_id: e for events in engine.run() for e in events if e.finished}
    assert finished["digits"].finish_reason == "error" and engine.output("digits").token_ids == []
    assert "regex" in finished["digits"].error and "cannot be completed" in finished["digits"].error
    assert finished["plain"].finish_reason == "length" and len(engine.output("plain").token_ids) == 8
    for rid in ("digits", "plain"):
        engine.release(rid)
    _assert_pages_free(llm)


def test_a_matcher_that_fails_mid_step_ends_only_its_request(smollm2, monkeypatch):
    """llguidance raising while a step asks a matcher what comes next (here: the regex
    request's, at its first token) ends that request with an error naming the failure; the
    JSON request in the same steps still completes and validates, and no page stays held."""
    from minivllm.sampling.constraint import TokenConstraint

    real = TokenConstraint.forced_token

    def failing(self):
        if self.structured.kind == "regex":
            raise RuntimeError("matcher exploded")
        return real(self)

    monkeypatch.setattr(TokenConstraint, "forced_token", failing)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    outs = smollm2.generate([_chat(smollm2, "A number, please."), _chat(smollm2, "A JSON object, please.")],
                            [SamplingParams(temperature=0, max_tokens=12, structured={"regex": "[0-9]+"}),
                             SamplingParams(temperature=0, max_tokens=40, structured={"json_schema": schema})])
    assert outs[0].finish_reason == "error" and "matcher exploded" in outs[0].error, outs[0]
    assert outs[1].finish_reason == "stop", outs[1]
    jsonschema.validate(json.loads(outs[1].text), schema)
    _assert_pages_free(smollm2)


@pytest.mark.parametrize("structured, field", [
    ({"regex": "a(b"}, "structured.regex"),
    ({"grammar": "start: missing_rule"}, "structured.grammar"),
    ({"json_schema": {"type": "strng"}}, "structured.json_schema"),
    ({"json_schema": "{not json"}, "structured.json_schema"),
    ({"regex": "a", "choice": ["b"]}, "structured"),
    ({"choice": []}, "structured.choice"),
    ({"pattern": "a"}, "structured"),
])
def test_a_constraint_that_does_not_compile_is_a_config_error_naming_the_field(structured, field):
    with pytest.raises(ConfigError) as info:
        SamplingParams(structured=structured)
    assert info.value.field == field


def test_structured_params_cross_the_wire_unchanged():
    from minivllm.serving.protocol import params_from_wire, params_to_wire

    p = SamplingParams(structured=StructuredOutput(json_schema=PERSON))
    back = params_from_wire(json.loads(json.dumps(params_to_wire(p))))
    assert back.structured == p.structured and back.structured.kind == "json_schema"
