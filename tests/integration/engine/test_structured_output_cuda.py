"""Structured output on a GPU: the masks are unpacked and applied on the device, decode
rows replay CUDA graphs, and speculation verifies constrained rows there. A tiny model the
test writes (random weights, byte-level vocabulary) carries it, so the run needs no model
file; validity is checked with `json` and `re`, independently of llguidance."""

from __future__ import annotations

import json
import re

import pytest
from synthetic_gguf import write_tiny_model

from minivllm.engine.llm import LLM
from minivllm.sampling.sampling_params import SamplingParams

pytestmark = pytest.mark.cuda

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"enum": ["red", "green", "blue"]}},
          "required": ["id", "tag"], "additionalProperties": False}
PHONE = r"[0-9]{3}-[0-9]{4}"


def _valid(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"id", "tag"} and isinstance(value["id"], int) and 0 <= value["id"] <= 99
            and value["tag"] in ("red", "green", "blue"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("structured") / "tiny.gguf")


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_constraints_hold_on_the_gpu_next_to_plain_rows(tiny, dtype):
    llm = LLM(str(tiny), device="cuda", dtype=dtype, max_model_len=256, progress=False)
    assert llm.engine.cuda_graphs_enabled
    params = ([SamplingParams(temperature=t, seed=s, max_tokens=60, structured={"json_schema": SCHEMA})
               for t, s in ((0, None), (1.0, 1), (1.0, 2))]
              + [SamplingParams(temperature=1.0, seed=s, max_tokens=20, structured={"regex": PHONE}) for s in range(3)]
              + [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * 2)
    outs = llm.generate([f"prompt {i}" for i in range(len(params))], params)
    for out in outs[:3]:
        assert out.finish_reason == "stop" and _valid(out.text), out.text
    for out in outs[3:6]:
        assert out.finish_reason == "stop" and re.fullmatch(PHONE, out.text), out.text
    plain = llm.generate(["prompt 6"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    assert outs[6].token_ids == plain.token_ids  # the masks of other rows leave a plain row alone


def test_speculation_on_the_gpu_keeps_the_constraint(tiny):
    plain = LLM(str(tiny), device="cuda", dtype="float32", max_model_len=256, progress=False)
    spec = LLM(str(tiny), device="cuda", dtype="float32", max_model_len=256, progress=False,
               draft_model=str(tiny), num_draft_tokens=4)
    greedy = SamplingParams(temperature=0, max_tokens=60, structured={"json_schema": SCHEMA})
    assert spec.generate("prompt", greedy)[0].text == plain.generate("prompt", greedy)[0].text
    outs = spec.generate(["prompt"] * 4, [SamplingParams(temperature=1.0, seed=s, max_tokens=60,
                                                         structured={"json_schema": SCHEMA}) for s in range(4)])
    assert all(o.finish_reason == "stop" and _valid(o.text) for o in outs), [o.text for o in outs]


NAMED = {"type": "object", "properties": {"name": {"type": "string", "minLength": 2, "maxLength": 24},
                                          "n": {"type": "integer"}},
         "required": ["name", "n"], "additionalProperties": False}


def test_the_gpu_draw_gives_the_masked_argmax(tiny, monkeypatch):
    """Greedy rows on the GPU take shortcuts: the token the grammar forces taken without a
    mask (no device round trip), masks computed beside the forward for narrow positions,
    the unmasked argmax checked for the others, then the top candidates queued behind its
    copy. Each row must get the tokens of masking every row before its argmax."""
    from minivllm.sampling import constraint as constraint_module
    from minivllm.sampling import step_draw

    llm = LLM(str(tiny), device="cuda", dtype="float32", max_model_len=256, progress=False)
    params = ([SamplingParams(temperature=0, max_tokens=50, structured={"json_schema": NAMED})] * 4
              + [SamplingParams(temperature=0, max_tokens=40, structured={"json_object": True})] * 2
              + [SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.3,
                                structured={"regex": r"[a-z ]{3,40}\."})] * 2)
    prompts = [f"prompt {i}" for i in range(len(params))]
    before = dict(llm.engine.constraints.counts)
    shortcut = [o.token_ids for o in llm.generate(prompts, params)]
    counts = {k: v - before[k] for k, v in llm.engine.constraints.counts.items()}
    # Every shortcut was taken: checks, masks beside the forward, tokens the grammar forced.
    assert counts["checked"] > 20 and counts["masked_ahead"] > 20 and counts["forced"] > 20, counts
    monkeypatch.setattr(step_draw, "checks_candidates", lambda p: False)
    monkeypatch.setattr(step_draw, "draws_forced", lambda req, wanted=False: False)
    monkeypatch.setattr(constraint_module, "draws_forced", lambda req, wanted=False: False)
    masked_first = [o.token_ids for o in llm.generate(prompts, params)]
    assert shortcut == masked_first
