"""The cost router's split candidates (serving/split_pricing.py), against hand arithmetic:
every term of a "prefill on A, decode on B" candidate, the choice against whole-request
placement, and the articles' break-even (2 GiB of K/V at 25 GB/s: about 86 ms, so
0.67 ms/token for a 128-token answer and 0.17 ms/token for a 512-token one)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from minivllm.errors import ConfigError
from minivllm.sampling.sampling_params import SamplingParams
from minivllm.serving.router import Candidate, IncomingRequest, Router
from minivllm.serving.split_pricing import SplitPricing
from minivllm.serving.split_request import check_split
from minivllm.serving.worker_rates import WorkerRates

KV_PER_TOKEN = 30 * 3 * 64 * 4 * 2  # SmolLM2-135M, f32, K and V


def rel(a, b):
    return math.isclose(a, b, rel_tol=1e-9)


def idle(name):
    return Candidate(name, True, active=0, queued=0, existing_prefill_tokens=0, existing_decode_tokens=0, max_active=1)


def rates():
    # A prefills fast and decodes slowly (a GPU with a decode backlog, in effect); B the other way round.
    return {"a": WorkerRates(prefill_tps=2000.0, decode_points={1: 20.0}),
            "b": WorkerRates(prefill_tps=100.0, decode_points={1: 50.0})}


def pricing(link=1e9, sampled=False, kinds=("cuda", "cpu")):
    return SplitPricing(link, {"a": KV_PER_TOKEN, "b": KV_PER_TOKEN}, {"a": 16, "b": 16},
                        dict(zip("ab", kinds)), sampled)


def test_a_split_is_priced_term_by_term_and_wins_where_it_pays():
    d = Router("cost+split").choose(IncomingRequest("r", 1000, 101), [idle("a"), idle("b")], rates(), pricing())
    whole = {c["worker"]: c["score"] for c in d["candidates"]}
    assert rel(whole["a"], 1000 / 2000 + 101 / 20) and rel(whole["b"], 1000 / 100 + 101 / 50)
    s = {(c["prefill"], c["decode"]): c for c in d["split_candidates"]}
    assert set(s) == {("a", "b"), ("b", "a")}
    ab = s[("a", "b")]
    moved = 992  # 62 full pages of 16
    transfer = moved * KV_PER_TOKEN / 1e9
    assert (ab["transfer_tokens"], ab["transfer_bytes"]) == (moved, moved * KV_PER_TOKEN)
    assert rel(ab["prefill_s"], 1000 / 2000 + 1 / 20) and rel(ab["transfer_s"], transfer)
    tail = 1000 + 1 - moved  # B recomputes the partial page and A's token
    assert rel(ab["decode_s"], 0.55 + transfer + tail / 100 + 100 / 50)
    assert rel(ab["drain_s"], tail / 100 + 100 / 50) and rel(ab["score"], ab["decode_s"])
    assert rel(ab["break_even_ms_per_token"], transfer * 1e3 / 101)
    assert d["split"] == {"prefill": "a", "decode": "b"} and d["chosen"] == "a" and "split" in d["reason"]


def test_a_short_answer_does_not_repay_the_split():
    d = Router("cost+split").choose(IncomingRequest("r", 1000, 3), [idle("a"), idle("b")], rates(), pricing())
    ab = next(c for c in d["split_candidates"] if c["prefill"] == "a")
    best_whole = min(c["score"] for c in d["candidates"])
    assert rel(best_whole, 0.5 + 3 / 20) and ab["score"] > best_whole  # 0.55 + transfer + 0.09 + 0.04
    assert d["split"] is None and d["chosen"] == "a" and d["reason"] == "cost"


def test_a_slow_link_or_a_marginal_gain_keeps_the_request_whole():
    slow = Router("cost+split").choose(IncomingRequest("r", 1000, 101), [idle("a"), idle("b")], rates(),
                                       pricing(link=1e7))
    assert slow["split"] is None  # 4.57 s of transfer
    # Within the 10% margin: whole on A 5.55 s, split 5.0+ s.
    close = {"a": WorkerRates(prefill_tps=2000.0, decode_points={1: 20.0}),
             "b": WorkerRates(prefill_tps=100.0, decode_points={1: 22.0})}
    d = Router("cost+split").choose(IncomingRequest("r", 1000, 101), [idle("a"), idle("b")], close, pricing())
    ab = next(c for c in d["split_candidates"] if c["prefill"] == "a")
    best_whole = min(c["score"] for c in d["candidates"])
    assert 0.9 * best_whole < ab["score"] < best_whole and d["split"] is None


def test_a_batching_gpu_with_long_answers_in_flight_keeps_a_short_request_whole():
    """The h100-s49 bench case (0.5B, 8 CPU cores): 24 greedy answers of ~3,000 tokens
    decoding on the GPU, then a 1024-token prompt with a 128-token answer. The GPU
    decodes it beside them at decode_tps(25) / 25 per request and served it in 0.37 s;
    the split took 1.9 s. By drain (the articles' score) the GPU's 72,000 tokens in
    flight would have cost 4.5 s and bought the split; by the request's own finish it
    stays whole."""
    rates = {"cuda:0": WorkerRates(prefill_tps=22000.0, decode_points={1: 940.0, 32: 16800.0}),
             "cpu": WorkerRates(prefill_tps=447.0, decode_points={1: 76.0})}
    gpu = Candidate("cuda:0", True, active=24, queued=0, existing_prefill_tokens=0, existing_decode_tokens=72000,
                    max_active=26, active_work=[(0, 3000)] * 24)
    cpu = Candidate("cpu", True, active=0, queued=0, existing_prefill_tokens=0, existing_decode_tokens=0,
                    max_active=26)
    p = SplitPricing(13.5e9, {"cuda:0": 12288.0, "cpu": 24576.0}, {"cuda:0": 16, "cpu": 16},
                     {"cuda:0": "cuda", "cpu": "cpu"}, False)
    d = Router("cost+split").choose(IncomingRequest("r", 1024, 128), [gpu, cpu], rates, p)
    by = {c["worker"]: c for c in d["candidates"]}
    rate25 = 940.0 + (16800.0 - 940.0) * 24 / 31  # interpolated between the measured batches
    assert rel(by["cuda:0"]["finish_s"], 1024 / 22000 + 128 / (rate25 / 25))
    assert rel(by["cuda:0"]["score"], by["cuda:0"]["finish_s"]) and by["cuda:0"]["score"] < 0.3
    split = next(c for c in d["split_candidates"] if c["prefill"] == "cuda:0")
    assert split["score"] > 1.5  # 127 tokens at 76 tok/s on the CPU
    assert by["cuda:0"]["drain_s"] > split["score"]  # what drain would have chosen
    assert d["split"] is None and d["chosen"] == "cuda:0" and d["reason"] == "cost"


def full_gpu(handoff_rows: int, handoffs: int) -> Candidate:
    """A GPU whose 4 slots all hold 2,000-token answers, and one request queued for a slot."""
    return Candidate("a", True, active=4, queued=1, existing_prefill_tokens=1000, existing_decode_tokens=8100,
                     max_active=4, active_work=[[0, 2000]] * 4, queued_work=[[1000, 100]],
                     handoff_rows=handoff_rows, handoffs=handoffs)


def test_a_free_handoff_row_takes_the_prefill_half_without_waiting_for_a_slot():
    """A GPU at its slot cap (4 answers of 2,000 tokens and one request queued): a whole
    request waits for a slot; a split's prefill half runs now in a handoff row (one
    step of the prompt at A's prefill rate and one decode step at A's concurrency), so
    the split wins, the articles' case in its only live form here."""
    gpu_rates = {"a": WorkerRates(prefill_tps=2000.0, decode_points={1: 20.0, 4: 80.0}),
                 "b": WorkerRates(prefill_tps=100.0, decode_points={1: 50.0})}
    d = Router("cost+split").choose(IncomingRequest("r", 1000, 101), [full_gpu(2, 0), idle("b")], gpu_rates,
                                    pricing())
    by = {c["worker"]: c for c in d["candidates"]}
    per_request = 80.0 / 4  # decode_tps(4) / 4
    # Whole on A: a slot frees after 2,000 tokens; the queued request takes it, the next one frees at the same time.
    assert rel(by["a"]["finish_s"], 2000 / per_request + 1000 / 2000 + 101 / per_request)
    ab = next(c for c in d["split_candidates"] if c["prefill"] == "a")
    assert rel(ab["prefill_s"], 1000 / 2000 + 4 / 80.0)
    tail = 1000 + 1 - 992
    assert rel(ab["score"], ab["prefill_s"] + ab["transfer_s"] + tail / 100 + 100 / 50)
    assert d["split"] == {"prefill": "a", "decode": "b"}
    # Both handoff rows taken: the prefill half waits for a slot like the whole request, and the split loses.
    d = Router("cost+split").choose(IncomingRequest("r", 1000, 101), [full_gpu(2, 2), idle("b")], gpu_rates,
                                    pricing())
    ab = next(c for c in d["split_candidates"] if c["prefill"] == "a")
    assert rel(ab["prefill_s"], 2000 / per_request + 1000 / 2000 + 1 / per_request)
    assert d["split"] is None


def test_sampled_requests_split_only_between_workers_of_one_device_kind():
    d = Router("cost+split").choose(IncomingRequest("r", 1000, 101), [idle("a"), idle("b")], rates(),
                              pricing(sampled=True))
    assert d["split_candidates"] == [] and d["split"] is None
    d = Router("cost+split").choose(IncomingRequest("r", 1000, 101), [idle("a"), idle("b")], rates(),
                              pricing(sampled=True, kinds=("cpu", "cpu")))
    assert d["split"] == {"prefill": "a", "decode": "b"}


def test_the_articles_break_even():
    kv = 2 * 2**30 / 8192  # 2 GiB for an 8k prompt
    for answer, per_token_ms in ((128, 0.67), (512, 0.17)):
        p = SplitPricing(25e9, {"a": kv, "b": kv}, {"a": 16, "b": 16}, {"a": "cuda", "b": "cpu"}, False)
        d = Router("cost+split").choose(IncomingRequest("r", 8192, answer), [idle("a"), idle("b")], rates(), p)
        ab = next(c for c in d["split_candidates"] if c["prefill"] == "a")
        assert ab["transfer_bytes"] == 2 * 2**30 and round(ab["transfer_s"] * 1e3) == 86
        assert round(ab["break_even_ms_per_token"], 2) == per_token_ms


def test_no_pricing_or_the_plain_cost_policy_means_no_split_candidates():
    d = Router("cost+split").choose(IncomingRequest("r", 1000, 101), [idle("a"), idle("b")], rates())
    assert d["split_candidates"] == [] and d["split"] is None
    d = Router("cost").choose(IncomingRequest("r", 1000, 101), [idle("a"), idle("b")], rates(), pricing())
    assert d["split_candidates"] == [] and d["split"] is None and d["chosen"] == "a"


def test_check_split_names_what_cannot_be_split():
    def worker(kind):
        return SimpleNamespace(healthy=True, state="ready", device=SimpleNamespace(kind=kind))

    workers = {"cpu": worker("cpu"), "cuda:0": worker("cuda"), "cpu#2": worker("cpu")}
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=1)
    assert check_split(("cuda:0", "cpu"), greedy, workers, "local") == ("cuda:0", "cpu")
    assert check_split(["cpu", "cpu#2"], sampled, workers, "local") == ("cpu", "cpu#2")
    with pytest.raises(ConfigError, match="ray backend does not support"):
        check_split(("cpu", "cpu#2"), greedy, workers, "ray")
    with pytest.raises(ConfigError, match="one device kind"):
        check_split(("cuda:0", "cpu"), sampled, workers, "local")
    with pytest.raises(ConfigError, match="a pair of worker names"):
        check_split("cpu", greedy, workers, "local")
    with pytest.raises(ConfigError, match="penalties"):
        check_split(("cpu", "cpu#2"), SamplingParams(presence_penalty=0.5), workers, "local")
