"""Record token ids from a fixed set of engine runs, to check that a refactor of the step
changes no output bit (issue 40: the step split into schedule / runner / update).

    python scripts/record_step_equivalence.py /tmp/before.json     # on the old code
    python scripts/record_step_equivalence.py /tmp/after.json      # on the new code
    python scripts/record_step_equivalence.py --compare /tmp/before.json /tmp/after.json

This is an equivalence check between two versions of the same code, not a correctness
test (the tests compare against independent references): keep the files outside git.
Runs on the CPU in float32 with the default model (SmolLM2-135M); the draft is the same
file with a perturbed final norm (spec/perturbed_draft.py), so acceptance is partial.
"""

from __future__ import annotations

import argparse
import json
import sys

PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):"]
SHARED = "You are a helpful assistant. Answer briefly and precisely. Question: "
TOKENS = 20


def runs(llm_cls, params_cls, structured_cls, draft):
    """(name, callable returning JSON-able results) for every recorded case."""
    base = llm_cls("smollm2-135m", device="cpu", dtype="float32", progress=False, max_model_len=256)
    greedy = params_cls(temperature=0.0, max_tokens=TOKENS)

    def seeded(i):
        return params_cls(temperature=0.9, top_p=0.9, top_k=40, seed=100 + i, max_tokens=TOKENS)

    def ids(outs):
        return [[o.token_ids, o.finish_reason, o.error] for o in outs]

    def spec_llm(**options):
        other = base.fork(**options)
        # The engine speculates when built with a draft model: rebuild it with one.
        from minivllm.engine.engine import LLMEngine
        from minivllm.engine.engine_config import EngineConfig

        opts = other.engine_options()
        mml = opts.pop("max_model_len")
        other.engine = LLMEngine(base.model, base.tokenizer, EngineConfig(max_model_len=mml, **opts),
                                 draft_model=draft, draft_tokenizer=base.tokenizer, draft_name="perturbed")
        return other

    def spec_stats(llm):
        snap = llm.snapshot()["speculative"]
        return {k: snap.get(k) for k in ("rounds", "proposed", "accepted", "bonus_tokens", "plain_steps", "tv_mean")}

    cases = {}
    cases["greedy_solo"] = lambda: [ids(base.generate(p, greedy)) for p in PROMPTS]
    cases["greedy_batched"] = lambda: ids(base.generate(PROMPTS, greedy))
    cases["seeded_solo"] = lambda: [ids(base.generate(p, seeded(i))) for i, p in enumerate(PROMPTS)]
    cases["seeded_batched"] = lambda: ids(base.generate(PROMPTS, [seeded(i) for i in range(len(PROMPTS))]))
    cases["logprobs_batched"] = lambda: [[o.token_ids, o.finish_reason, o.error] for o in base.generate(
        PROMPTS, params_cls(temperature=0.0, max_tokens=8, logprobs=3))]
    cases["gemm_only_batched"] = lambda: ids(base.fork(gemv_max_rows=0).generate(PROMPTS, greedy))
    cases["chunked_prefill"] = lambda: ids(base.fork(max_batched_tokens=5).generate(PROMPTS, greedy))

    def flight(mode):
        llm = base.fork(single_flight=mode, page_size=4)
        prompts = [SHARED + "what is 2+2?"] * 3 + [SHARED + "name a colour."]
        params = [greedy, seeded(0), seeded(1), greedy]
        return ids(llm.generate(prompts, params)) + [ids(llm.generate(prompts[:2], params[:2]))]

    cases["single_flight_after_prefill"] = lambda: flight("after_prefill")
    cases["single_flight_at_completion"] = lambda: flight("at_completion")
    cases["prefix_cache_at_completion"] = lambda: ids(base.fork(page_size=4, publication="at_completion").generate(
        [SHARED + "a", SHARED + "b", SHARED + "a"], greedy))

    def spec(options, params, *, stats=True):
        llm = spec_llm(**options)
        solo = [ids(llm.generate(p, params(i))) for i, p in enumerate(PROMPTS[:2])]
        batched = ids(llm.generate(PROMPTS, [params(i) for i in range(len(PROMPTS))]))
        # The pay-off gate weighs measured step times: its rounds are not reproducible.
        return {"solo": solo, "batched": batched, "stats": spec_stats(llm) if stats else None}

    cases["spec_greedy"] = lambda: spec({"draft_policy": "fixed", "num_draft_tokens": 3}, lambda i: greedy)
    cases["spec_seeded"] = lambda: spec({"draft_policy": "fixed", "num_draft_tokens": 3}, seeded)
    cases["spec_mentored"] = lambda: spec({"draft_policy": "fixed", "num_draft_tokens": 3, "tv_budget": 0.3}, seeded)
    cases["spec_adaptive_gate"] = lambda: spec({"draft_policy": "accepted-length+gate"}, lambda i: greedy,
                                               stats=False)
    cases["spec_single_flight"] = lambda: ids(spec_llm(single_flight="after_prefill", page_size=4).generate(
        [SHARED + "x"] * 3, [greedy, seeded(1), seeded(2)]))

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}

    def structured(i, temperature):
        return params_cls(temperature=temperature, seed=7 + i, max_tokens=30,
                          structured=structured_cls(json_schema=schema))

    cases["structured_greedy_batched"] = lambda: ids(base.generate(
        ["Describe a person as JSON:", "JSON for Ada:"], [structured(0, 0.0), structured(1, 0.0)]))
    cases["structured_mixed_batched"] = lambda: ids(base.generate(
        ["Describe a person as JSON:", "Once upon", "JSON for Bob:"],
        [structured(0, 0.8), greedy, structured(2, 0.0)]))
    cases["structured_spec"] = lambda: ids(spec_llm(num_draft_tokens=3).generate(
        ["Describe a person as JSON:", "JSON for Ada:"], [structured(0, 0.0), structured(1, 0.7)]))
    return cases


def record(path: str) -> None:
    import torch

    from minivllm import LLM, SamplingParams
    from minivllm.models import resolve_model
    from minivllm.sampling.structured import StructuredOutput
    from minivllm.spec.perturbed_draft import perturbed_copy

    torch.set_num_threads(1)
    draft = perturbed_copy(resolve_model("smollm2-135m", progress=False), noise=0.5, seed=1)
    results = {}
    for name, fn in runs(LLM, SamplingParams, StructuredOutput, draft).items():
        results[name] = fn()
        print(name, json.dumps(results[name])[:160], flush=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


def compare(before: str, after: str) -> int:
    a, b = json.load(open(before)), json.load(open(after))
    bad = [k for k in a if a[k] != b.get(k)]
    for k in a:
        print(("DIFFERENT " if k in bad else "same      ") + k)
    return 1 if bad else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--compare", action="store_true")
    args = ap.parse_args()
    sys.exit(compare(*args.paths) if args.compare else record(args.paths[0]))
