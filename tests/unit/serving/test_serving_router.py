"""Serving control plane without processes: device lists, routing policies, rates, the
controller's view of a worker.

References are exact arithmetic done here: the cost policy must reproduce the
mini-vllm-rs article's worked example (requests 7 and 8) term by term, the rate model
its documented interpolation and EWMA, and `WorkerHandle.candidate()` the documented
counting rules over a hand-built in-flight ledger.
"""

from __future__ import annotations

import json
import math

import pytest

from minivllm.errors import ConfigError, DeviceError
from minivllm.sampling.sampling_params import SamplingParams
from minivllm.serving.inference_devices import InferenceDevice, parse_inference_devices
from minivllm.serving.request_stream import RequestStream
from minivllm.serving.router import Candidate, IncomingRequest, NoWorkerAvailable, Router, parse_router_policy
from minivllm.serving.worker_handle import InFlight, WorkerHandle
from minivllm.serving.worker_rates import ALPHA, CLAMP, WorkerRates, load_profile, profile_of


def rel(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


# -- parse_inference_devices -----------------------------------------------------------------


def test_cpu_entries_threads_and_names():
    (d,) = parse_inference_devices(["cpu"], cpu_cores=8)
    assert (d.kind, d.index, d.threads, d.name, d.torch_device) == (
        "cpu",
        None,
        7,
        "cpu",
        "cpu",
    )  # one core kept for the controller
    (d,) = parse_inference_devices("cpu:4", cpu_cores=8)
    assert (d.kind, d.threads, d.name) == ("cpu", 4, "cpu")
    two = parse_inference_devices(["cpu", "cpu"], cpu_cores=8)
    assert [(x.name, x.threads) for x in two] == [("cpu", 3), ("cpu#2", 3)]
    three = parse_inference_devices(["cpu:1", "cpu", "CPU:2"], cpu_cores=9)
    assert [(x.name, x.threads) for x in three] == [("cpu", 1), ("cpu#2", 5), ("cpu#3", 2)]  # 9 - 1 reserved - 3 pinned
    assert len({x.name for x in three}) == 3
    assert three[1].as_dict() == {
        "kind": "cpu",
        "index": None,
        "threads": 5,
        "name": "cpu#2",
        "torch_device": "cpu",
        "node": None,
        "cpus": None,  # not pinned (Cluster(pin_cpus=True) fills it in)
    }


def test_gpu_claims_next_unclaimed_index():
    devs = parse_inference_devices(["gpu", "cuda:0"], cuda_count=2)
    assert [(d.kind, d.index, d.name, d.torch_device) for d in devs] == [("cuda", 1, "cuda:1", "cuda:1"),
                                                                         ("cuda", 0, "cuda:0", "cuda:0")]
    assert [d.index for d in parse_inference_devices(["gpu", "gpu"], cuda_count=2)] == [0, 1]
    assert [d.index for d in parse_inference_devices(["cuda", "gpu"], cuda_count=2)] == [0, 1]
    mixed = parse_inference_devices(["cpu", "gpu", "cpu"], cuda_count=1, cpu_cores=8)
    assert [d.name for d in mixed] == ["cpu", "cuda:0", "cpu#2"]
    assert [d.threads for d in mixed] == [3, 1, 3]  # 8 cores - 1 for the GPU worker - 1 for the controller
    kaggle = parse_inference_devices(["cpu", "gpu", "gpu"], cuda_count=2, cpu_cores=4)
    assert [d.threads for d in kaggle] == [2, 1, 1]
    assert parse_inference_devices(["cpu"], cpu_cores=2)[0].threads == 2


def test_third_gpu_on_two_devices_is_a_device_error():
    with pytest.raises(DeviceError, match="'gpu'") as exc:
        parse_inference_devices(["gpu", "gpu", "gpu"], cuda_count=2)
    assert "no unclaimed CUDA device" in str(exc.value)
    with pytest.raises(DeviceError, match="'gpu'"):
        parse_inference_devices(["cuda:0", "cuda:1", "gpu"], cuda_count=2)
    with pytest.raises(DeviceError, match="'gpu'"):
        parse_inference_devices(["gpu"], cuda_count=0)


def test_explicit_index_errors():
    with pytest.raises(ConfigError) as exc:
        parse_inference_devices(["cuda:1", "gpu", "cuda:1"], cuda_count=2)
    assert exc.value.field == "inference_device" and exc.value.value == "cuda:1"
    with pytest.raises(DeviceError, match="cuda:5"):
        parse_inference_devices(["cuda:5"], cuda_count=2)
    with pytest.raises(DeviceError, match="cuda:2"):
        parse_inference_devices(["cpu", "cuda:2"], cuda_count=2)


@pytest.mark.parametrize("spec", ["tpu", "cpu:0", "cpu:x", "cuda:-1", "cuda:a", "gpu:1", ""])
def test_garbage_entries_are_config_errors(spec):
    with pytest.raises(ConfigError) as exc:
        parse_inference_devices(["cpu", spec], cuda_count=2)
    assert exc.value.field == "inference_device"
    assert exc.value.value == spec


def test_empty_device_list():
    with pytest.raises(ConfigError) as exc:
        parse_inference_devices([])
    assert exc.value.field == "inference_device"


# -- the cost policy: the article's worked example --------------------------------------------

CPU_RATES = dict(prefill=73.0, decode=45.0)
GPU_RATES = dict(prefill=2551.0, decode=293.0)


def article_rates() -> dict[str, WorkerRates]:
    # One decode point: the same decode rate at every batch size, as in the article.
    return {"cpu": WorkerRates(prefill_tps=CPU_RATES["prefill"], decode_points={1: CPU_RATES["decode"]}),
            "cuda:0": WorkerRates(prefill_tps=GPU_RATES["prefill"], decode_points={1: GPU_RATES["decode"]})}


def article_candidates(gpu_queued: int, gpu_active_left: int, max_active: int = 16) -> list[Candidate]:
    """The article's state: 4 active GPU requests with `gpu_active_left` decode tokens
    left in all (spread evenly), `gpu_queued` queued 516-token prompts holding 496
    cached tokens and a 128-token budget each; the CPU idle."""
    active = [(0, gpu_active_left // 4)] * 4
    queued = [(20, 128)] * gpu_queued
    work = active + queued
    return [Candidate("cpu", True, active=0, queued=0, existing_prefill_tokens=0, existing_decode_tokens=0,
                      max_active=max_active, cached_tokens=496),
            Candidate("cuda:0", True, active=4, queued=gpu_queued, existing_prefill_tokens=sum(p for p, _ in work),
                      existing_decode_tokens=sum(d for _, d in work), max_active=max_active, cached_tokens=496,
                      active_work=active, queued_work=queued)]


def check_priced(record: dict, expected: dict[str, tuple[float, float, float, float, int, float]]) -> None:
    """expected: worker -> (prefill_s, decode_s, prefill_tps, decode_tps, concurrency, finish_s)."""
    by_name = {c["worker"]: c for c in record["candidates"]}
    assert set(by_name) == set(expected)
    for name, (prefill_s, decode_s, ptps, dtps, conc, finish_s) in expected.items():
        c = by_name[name]
        assert rel(c["prefill_s"], prefill_s), (name, c["prefill_s"], prefill_s)
        assert rel(c["decode_s"], decode_s), (name, c["decode_s"], decode_s)
        assert rel(c["drain_s"], prefill_s + decode_s), (name, c["drain_s"])
        assert rel(c["finish_s"], finish_s), (name, c["finish_s"], finish_s)
        assert rel(c["score"], finish_s), (name, c["score"])  # the request's own finish; drain is shown
        assert c["prefill_tps"] == ptps and c["decode_tps"] == dtps and c["concurrency"] == conc


def test_cost_article_request_7_goes_to_gpu():
    router = Router("cost")
    rec = router.choose(IncomingRequest("req-7", prompt_tokens=516, max_tokens=128),
                        article_candidates(gpu_queued=2, gpu_active_left=496), article_rates())
    cpu = (20 / 73, 128 / 45)
    gpu = (60 / 2551, 880 / 293)
    assert round(sum(cpu), 3) == 3.118 and round(sum(gpu), 3) == 3.027  # the article's printed scores
    # With 16 slots nothing waits for a slot: finish = own prefill + 128 tokens at the
    # per-request rate decode_tps / concurrency (7 requests share the GPU's 293 tok/s).
    cpu_finish = 20 / 73 + 128 / 45
    gpu_finish = 20 / 2551 + 128 / (293 / 7)
    check_priced(rec, {"cpu": (*cpu, 73.0, 45.0, 1, cpu_finish), "cuda:0": (*gpu, 2551.0, 293.0, 7, gpu_finish)})
    assert rec["chosen"] == "cuda:0" and rec["reason"] == "cost" and rec["policy"] == "cost"
    assert rec["request_id"] == "req-7" and rec["prompt_tokens"] == 516 and rec["max_tokens"] == 128
    by_name = {c["worker"]: c for c in rec["candidates"]}
    assert by_name["cpu"]["incoming_prefill_tokens"] == 20 == by_name["cuda:0"]["incoming_prefill_tokens"]
    assert by_name["cpu"]["incoming_decode_tokens"] == 128 == by_name["cuda:0"]["incoming_decode_tokens"]
    assert list(router.decisions) == [rec]
    assert router.counters == {"decisions": 1, "fallbacks": 0, "no_worker": 0, "splits": 0}


def test_cost_article_request_8_goes_to_cpu():
    router = Router("cost")
    rec = router.choose(IncomingRequest("req-8", prompt_tokens=516, max_tokens=128),
                        article_candidates(gpu_queued=3, gpu_active_left=488), article_rates())
    cpu = (20 / 73, 128 / 45)
    gpu = (80 / 2551, 1000 / 293)
    assert round(sum(cpu), 3) == 3.118 and round(sum(gpu), 3) == 3.444
    check_priced(rec, {"cpu": (*cpu, 73.0, 45.0, 1, sum(cpu)),
                       "cuda:0": (*gpu, 2551.0, 293.0, 8, 20 / 2551 + 128 / (293 / 8))})
    assert rec["chosen"] == "cpu" and rec["reason"] == "cost"


def test_cost_full_slots_delay_the_incoming_request():
    # The article's real limit was 4 active per worker: request 7 then waits for a GPU
    # slot. Each active request has 124 tokens left at 293/4 tok/s per request; the two
    # queued requests take the first two slots, request 7 the third.
    rec = Router("cost").choose(IncomingRequest("req-7", prompt_tokens=516, max_tokens=128),
                                article_candidates(gpu_queued=2, gpu_active_left=496, max_active=4), article_rates())
    per_request = 293 / 4
    slot_free = 124 / per_request
    gpu_finish = slot_free + 20 / 2551 + 128 / per_request
    gpu = {c["worker"]: c for c in rec["candidates"]}["cuda:0"]
    assert rel(gpu["drain_s"], 60 / 2551 + 880 / 293)  # unchanged: 3.027 s
    assert rel(gpu["finish_s"], gpu_finish) and round(gpu_finish, 3) == 3.448
    assert rel(gpu["score"], gpu_finish)
    assert rec["chosen"] == "cpu"  # 3.118 s beats waiting 1.69 s for a slot


def test_cost_finish_replays_queued_requests_in_slot_order():
    rates = {"w": WorkerRates(prefill_tps=100.0, decode_points={1: 10.0, 2: 20.0})}
    # 2 slots, per-request rate 20/2 = 10 tok/s. Active: 10 and 30 tokens left (1 s, 3 s).
    # Queued A (50 prefill, 20 decode: 0.5 + 2 s) takes the slot free at 1 s -> 3.5 s;
    # queued B (0, 10: 1 s) takes the slot free at 3 s -> 4 s; incoming takes 3.5 s.
    c = Candidate("w", True, active=2, queued=2, existing_prefill_tokens=50, existing_decode_tokens=70, max_active=2,
                  active_work=[(0, 10), (0, 30)], queued_work=[(50, 20), (0, 10)])
    rec = Router("cost").choose(IncomingRequest("r", prompt_tokens=10, max_tokens=5), [c], rates)
    (got,) = rec["candidates"]
    assert rel(got["finish_s"], 3.5 + 10 / 100 + 5 / 10)
    assert rel(got["drain_s"], 60 / 100 + 75 / 20)
    assert rel(got["score"], got["finish_s"]) and got["drain_s"] > got["finish_s"]


def test_cost_prompt_shorter_than_cache_estimate_costs_no_prefill():
    rates = {"a": WorkerRates(prefill_tps=100.0, decode_points={1: 10.0})}
    rec = Router("cost").choose(IncomingRequest("r", 8, 5),
                                [Candidate("a", True, 0, 0, 0, 0, max_active=4, cached_tokens=20)], rates)
    (c,) = rec["candidates"]
    assert c["incoming_prefill_tokens"] == 0 and c["prefill_s"] == 0.0 and rel(c["decode_s"], 0.5)


# -- batch-dependent decode rate ------------------------------------------------------------------


def test_decode_rate_interpolates_without_extrapolating():
    r = WorkerRates(prefill_tps=100.0, decode_points={1: 10.0, 4: 40.0})
    assert r.known
    assert r.decode_rate(1) == 10.0 and r.decode_rate(4) == 40.0
    assert r.decode_rate(2) == 20.0 and r.decode_rate(3) == 30.0
    assert r.decode_rate(8) == 40.0 and r.decode_rate(100) == 40.0
    assert r.decode_rate(0) == 10.0
    r3 = WorkerRates(prefill_tps=1.0, decode_points={1: 10.0, 4: 40.0, 8: 60.0})
    assert r3.decode_rate(6) == 50.0
    assert WorkerRates(prefill_tps=1.0).decode_rate(2) is None
    assert not WorkerRates(prefill_tps=1.0).known and not WorkerRates(decode_points={1: 1.0}).known


def test_cost_uses_concurrency_min_max_active_in_flight_plus_one():
    rates = {n: WorkerRates(prefill_tps=100.0, decode_points={1: 10.0, 4: 40.0}) for n in ("a", "b", "c", "d")}
    cands = [
        Candidate("a", True, active=0, queued=0, existing_prefill_tokens=0, existing_decode_tokens=0, max_active=8),
        Candidate("b", True, active=1, queued=0, existing_prefill_tokens=0, existing_decode_tokens=30, max_active=8),
        Candidate("c", True, active=5, queued=2, existing_prefill_tokens=10, existing_decode_tokens=200, max_active=3),
        Candidate("d", True, active=6, queued=1, existing_prefill_tokens=0, existing_decode_tokens=100, max_active=16),
    ]
    rec = Router("cost").choose(IncomingRequest("r", prompt_tokens=50, max_tokens=20), cands, rates)
    by = {c["worker"]: c for c in rec["candidates"]}
    expected = {"a": (1, 10.0), "b": (2, 20.0), "c": (3, 30.0), "d": (8, 40.0)}
    for name, (conc, rate) in expected.items():
        assert by[name]["concurrency"] == conc and by[name]["decode_tps"] == rate, (name, by[name])
    assert rel(by["a"]["drain_s"], 50 / 100 + 20 / 10)
    assert rel(by["b"]["drain_s"], 50 / 100 + 50 / 20)
    assert rel(by["c"]["drain_s"], 60 / 100 + 220 / 30)
    assert rel(by["d"]["drain_s"], 50 / 100 + 120 / 40)
    for name, (conc, rate) in expected.items():
        # no per-request work listed: every slot is free, finish = own prefill + own decode
        assert rel(by[name]["finish_s"], 50 / 100 + 20 / (rate / conc)), name
        assert rel(by[name]["score"], by[name]["finish_s"]), name
    assert rec["chosen"] == "a"


# -- other policies --------------------------------------------------------------------------------


def cands(*specs) -> list[Candidate]:
    """specs: (name, healthy, active, queued, decode_tokens)."""
    return [Candidate(n, h, a, q, 0, d, max_active=4) for n, h, a, q, d in specs]


def test_cost_falls_back_to_least_loaded_without_rates():
    rates = {"a": WorkerRates(prefill_tps=100.0, decode_points={1: 10.0}), "b": WorkerRates()}
    router = Router("cost")
    rec = router.choose(IncomingRequest("r", 10, 10), cands(("a", True, 3, 0, 30), ("b", True, 1, 0, 5)), rates)
    assert rec["chosen"] == "b"  # fewer in flight, although only "a" could be priced
    assert rec["reason"].startswith("least-loaded") and "b" in rec["reason"] and "no measured rates" in rec["reason"]
    assert router.counters["fallbacks"] == 1
    # a worker absent from the rates map entirely counts as unpriced too
    rec = router.choose(
        IncomingRequest("r2", 10, 10), cands(("a", True, 0, 0, 0), ("c", True, 2, 0, 0)), {"a": rates["a"]}
    )
    assert rec["chosen"] == "a" and "least-loaded" in rec["reason"] and "c" in rec["reason"]
    # an unhealthy worker without rates does not force a fallback: it is not a candidate
    rec = router.choose(IncomingRequest("r3", 10, 10), cands(("a", True, 3, 0, 0), ("b", False, 0, 0, 0)), rates)
    assert rec["chosen"] == "a" and rec["reason"] == "cost"
    assert [c["worker"] for c in rec["candidates"]] == ["a", "b"]
    assert rec["candidates"][1]["healthy"] is False and rec["candidates"][1]["score"] is None


def test_round_robin_cycles_and_skips_unhealthy():
    router = Router("round-robin")
    three = cands(("a", True, 0, 0, 0), ("b", True, 9, 9, 9), ("c", True, 0, 0, 0))
    picks = [router.choose(IncomingRequest(f"r{i}", 1, 1), three)["chosen"] for i in range(5)]
    assert picks == ["a", "b", "c", "a", "b"]
    router = Router("round-robin")
    skip = cands(("a", True, 0, 0, 0), ("b", False, 0, 0, 0), ("c", True, 0, 0, 0))
    picks = [router.choose(IncomingRequest(f"r{i}", 1, 1), skip)["chosen"] for i in range(4)]
    assert picks == ["a", "c", "a", "c"]
    assert all(r["reason"] == "round-robin" for r in router.decisions)


def test_least_loaded_picks_fewest_in_flight():
    router = Router("least-loaded")
    rec = router.choose(
        IncomingRequest("r", 1, 1),
        cands(("a", True, 2, 1, 0), ("b", True, 1, 1, 500), ("c", False, 0, 0, 0), ("d", True, 3, 0, 0)),
    )
    assert rec["chosen"] == "b"
    rec = router.choose(IncomingRequest("r", 1, 1), cands(("a", True, 1, 1, 90), ("b", True, 2, 0, 80)))
    assert rec["chosen"] == "b"  # tie on in-flight: less decode work


def test_forced_policy():
    c = cands(("cpu", True, 5, 5, 500), ("cpu#2", True, 0, 0, 0))
    assert Router("forced:cpu").choose(IncomingRequest("r", 1, 1), c)["chosen"] == "cpu"
    down = cands(("cpu", False, 0, 0, 0), ("cpu#2", True, 0, 0, 0))
    router = Router("forced:cpu")
    with pytest.raises(NoWorkerAvailable, match="cpu"):
        router.choose(IncomingRequest("r", 1, 1), down)
    assert router.counters["no_worker"] == 1 and not router.decisions
    with pytest.raises(ConfigError) as exc:
        Router("forced:cuda:3").choose(IncomingRequest("r", 1, 1), c)
    assert exc.value.field == "router" and "cuda:3" in str(exc.value)


@pytest.mark.parametrize("policy", ["round-robin", "least-loaded", "cost", "forced:a"])
def test_no_healthy_worker(policy):
    router = Router(policy)
    rates = {"a": WorkerRates(prefill_tps=1.0, decode_points={1: 1.0})}
    with pytest.raises(NoWorkerAvailable):
        router.choose(IncomingRequest("r", 1, 1), cands(("a", False, 0, 0, 0), ("b", False, 0, 0, 0)), rates)
    with pytest.raises(NoWorkerAvailable):
        router.choose(IncomingRequest("r", 1, 1), [], rates)
    assert router.counters["no_worker"] == 2 and router.counters["decisions"] == 0


@pytest.mark.parametrize("policy", ["random", "forced:", "", "Cost", None, "least_loaded"])
def test_bad_policy_is_config_error(policy):
    with pytest.raises(ConfigError) as exc:
        Router(policy)
    assert exc.value.field == "router"
    with pytest.raises(ConfigError):
        parse_router_policy(policy)


def test_router_snapshot_and_ring_buffer():
    router = Router("round-robin", history=3)
    for i in range(5):
        router.choose(IncomingRequest(f"r{i}", 1, 1), cands(("a", True, 0, 0, 0)))
    snap = router.snapshot()
    assert snap["policy"] == "round-robin" and snap["counters"]["decisions"] == 5
    assert [d["request_id"] for d in snap["decisions"]] == ["r2", "r3", "r4"]
    assert json.loads(json.dumps(snap)) == snap


# -- WorkerRates: online correction, wire format, profiles --------------------------------------------


def test_observe_decode_step_nudges_correction():
    assert ALPHA == 0.2 and CLAMP == 8.0
    r = WorkerRates(prefill_tps=100.0, decode_points={1: 10.0, 4: 40.0})
    # batch 4 at twice the calibrated 40 tok/s: 4 rows in 0.05 s
    r.observe_step(prefill_tokens=0, decode_rows=4, duration_s=4 / 80.0)
    assert math.isclose(r.decode_correction_at(4), 0.8 * 1.0 + 0.2 * 2.0, rel_tol=1e-12)  # 1.2
    assert r.decode_correction_at(1) == r.decode_correction_at(4)  # unobserved: borrows the nearest
    assert r.prefill_correction == 1.0 and r.observations == {"prefill": 0, "decode": 1}
    assert math.isclose(r.decode_rate(4), 48.0, rel_tol=1e-12) and math.isclose(r.decode_rate(2), 24.0, rel_tol=1e-12)
    # again at 2x: 0.8 * 1.2 + 0.4
    r.observe_step(0, 1, 1 / 20.0)  # batch 1 starts from its neighbour's 1.2
    assert math.isclose(r.decode_correction_at(1), 0.8 * 1.2 + 0.2 * 2.0, rel_tol=1e-12)
    assert math.isclose(r.decode_correction_at(4), 1.2, rel_tol=1e-12)  # kept per batch size
    # a too-short step and an unknown-rate worker are ignored
    before = dict(r.decode_corrections)
    r.observe_step(0, 4, 1e-6)
    assert r.decode_corrections == before and r.observations["decode"] == 2
    blank = WorkerRates()
    blank.observe_step(0, 4, 0.1)
    assert blank.decode_corrections == {} and blank.observations == {"prefill": 0, "decode": 0}


def test_corrections_are_clamped():
    r = WorkerRates(prefill_tps=100.0, decode_points={1: 10.0})
    for _ in range(200):
        r.observe_step(0, 1, 1 / 1000.0)  # 100x faster than calibrated
    assert r.decode_correction_at(1) == CLAMP
    for _ in range(200):
        r.observe_step(0, 1, 100.0)  # 1000x slower
    assert r.decode_correction_at(1) == 1 / CLAMP
    for _ in range(200):
        r.observe_step(10_000, 0, 1e-3)  # 10^7 tok/s prefill
    assert r.prefill_correction == CLAMP


def test_mixed_step_prefill_correction_subtracts_decode_share():
    r = WorkerRates(prefill_tps=100.0, decode_points={1: 10.0, 4: 40.0})
    # 2 decode rows at the calibrated batch-2 rate (20 tok/s) take 0.1 s; 100 prefill
    # tokens at 2x (200 tok/s) take 0.5 s.
    r.observe_step(prefill_tokens=100, decode_rows=2, duration_s=0.6)
    assert math.isclose(r.prefill_correction, 1.2, rel_tol=1e-12)
    assert r.decode_corrections == {} and r.observations == {"prefill": 1, "decode": 0}
    # prefill-only step: no decode share
    r2 = WorkerRates(prefill_tps=100.0, decode_points={1: 10.0})
    r2.observe_step(50, 0, 1.0)  # 50 tok/s = 0.5x
    assert math.isclose(r2.prefill_correction, 0.8 + 0.2 * 0.5, rel_tol=1e-12)
    # decode share covers the whole step: nothing to learn about prefill
    r3 = WorkerRates(prefill_tps=100.0, decode_points={1: 10.0})
    r3.observe_step(100, 1, 0.1)
    assert r3.prefill_correction == 1.0 and r3.observations["prefill"] == 0


def test_as_dict_from_dict_keeps_corrected_rates():
    r = WorkerRates(prefill_tps=100.0, decode_points={1: 10.0, 4: 40.0}, source="calibration")
    r.observe_step(0, 4, 4 / 80.0)
    r.observe_step(100, 2, 100 / 150.0 + 2 / r.decode_rate(2))
    wire = json.loads(json.dumps(r.as_dict()))
    assert wire["calibrated"] == {"prefill_tps": 100.0, "decode_tps": {"1": 10.0, "4": 40.0}}
    back = WorkerRates.from_dict(wire)
    assert back.known and back.source == "calibration"
    assert math.isclose(back.prefill_rate(), r.prefill_rate(), rel_tol=1e-12)
    for b in (1, 2, 3, 4, 9):
        assert math.isclose(back.decode_rate(b), r.decode_rate(b), rel_tol=1e-12), b
    assert back.observations == {"prefill": 1, "decode": 1}
    assert math.isclose(back.decode_rate(4), 48.0, rel_tol=1e-12)
    assert not WorkerRates.from_dict(None).known and not WorkerRates.from_dict(WorkerRates().as_dict()).known


def test_load_profile(tmp_path):
    path = tmp_path / "rates.json"
    path.write_text(json.dumps({"workers": {"cpu": {"prefill_tps": 73, "decode_tps": {"1": 45, "4": 120}},
                                            "cuda:0": {"prefill_tps": 0, "decode_tps": {"1": 293}},
                                            "cuda:1": {"prefill_tps": 2551, "decode_tps": {"1": 293, "4": -1}},
                                            "cuda:2": {"prefill_tps": 2551, "decode_tps": {}},
                                            "cuda:3": {"decode_tps": {"1": 293}}}}))
    r = load_profile(path, "cpu")
    assert r.source == "profile" and r.prefill_rate() == 73.0 and r.decode_points == {1: 45.0, 4: 120.0}
    assert r.decode_rate(2) == 45.0 + 75.0 / 3
    for worker in ("cuda:0", "cuda:1", "cuda:2", "cuda:3", "cuda:9"):
        with pytest.raises(ConfigError) as exc:
            load_profile(path, worker)
        assert exc.value.field == "rates_profile"
        assert str(path) in str(exc.value) and repr(worker) in str(exc.value), str(exc.value)
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError) as exc:
        load_profile(missing, "cpu")
    assert exc.value.field == "rates_profile" and str(missing) in str(exc.value)
    assert "no such file" in str(exc.value)


def test_a_written_profile_reads_back_as_the_rates_it_came_from(tmp_path):
    # Reference: the file format written by hand in test_load_profile above.
    rates = WorkerRates(prefill_tps=73.0, decode_points={1: 45.0, 4: 120.0}, source="calibration",
                        context_s=2e-6, calibration_context=128)
    profile = profile_of("smollm2-135m", {"cpu": rates, "cuda:0": WorkerRates()})
    assert profile == {"model": "smollm2-135m",
                       "workers": {"cpu": {"prefill_tps": 73.0, "decode_tps": {"1": 45.0, "4": 120.0},
                                           "context_s": 2e-6, "calibration_context": 128}}}
    path = tmp_path / "rates.json"
    path.write_text(json.dumps(profile))
    back = load_profile(path, "cpu")
    assert back.prefill_rate() == 73.0 and back.decode_points == {1: 45.0, 4: 120.0}
    assert (back.context_s, back.calibration_context) == (2e-6, 128)


# -- WorkerHandle.candidate(): the ledger as the router sees it ---------------------------------------


def flight(rid: str, prompt: int, cached: int, max_tokens: int, output: int = 0) -> tuple[str, InFlight]:
    return rid, InFlight(
        RequestStream(rid, None, list(range(prompt))), prompt, cached, max_tokens, output_tokens=output
    )


def test_worker_handle_candidate_counts():
    device = parse_inference_devices(["cpu"])[0]
    handle = WorkerHandle(device, {})
    assert handle.transport is None and handle.state == "starting" and not handle.healthy
    handle.state = "ready"
    handle.info = {"max_active_requests": 4}
    handle.in_flight = dict([
        flight("decoding", prompt=30, cached=0, max_tokens=20, output=5),       # active: 15 decode
        flight("decoding-running", prompt=40, cached=0, max_tokens=10, output=3),  # active: 7 decode (tokens win)
        flight("prefilling", prompt=40, cached=16, max_tokens=8),               # running, computed 10 < cached 16
        flight("prefilling-2", prompt=40, cached=16, max_tokens=6),             # running, computed 32
        flight("queued", prompt=50, cached=32, max_tokens=10),                  # not running yet
        flight("queued-2", prompt=12, cached=0, max_tokens=3),
        flight("done-prefill", prompt=20, cached=0, max_tokens=4),              # running, computed past the prompt
    ])
    # the worker's last "progress" message: running request -> prompt tokens computed
    handle.running = {
        "decoding-running": 40,
        "prefilling": 10,
        "prefilling-2": 32,
        "done-prefill": 20,
        "someone-else": 5,  # not in the ledger (finished meanwhile): ignored
    }
    c = handle.candidate(cached_tokens=7)
    assert c.worker == "cpu" and c.healthy and c.max_active == 4 and c.cached_tokens == 7
    assert c.active == 5 and c.queued == 2 and c.in_flight == 7
    assert c.existing_prefill_tokens == (40 - 16) + (40 - 32) + (50 - 32) + 12 + 0
    assert c.existing_decode_tokens == 15 + 7 + 8 + 6 + 10 + 3 + 4

    # no progress message yet: everything without output is queued at its routing estimate
    handle.running = {}
    c = handle.candidate()
    assert c.active == 2 and c.queued == 5
    assert c.existing_prefill_tokens == (40 - 16) + (40 - 16) + (50 - 32) + 12 + 20
    assert c.existing_decode_tokens == 15 + 7 + 8 + 6 + 10 + 3 + 4

    # a dead worker is a candidate the router must skip
    handle.state = "dead"
    handle.in_flight = {}
    c = handle.candidate()
    assert not c.healthy and c.in_flight == 0 and c.existing_prefill_tokens == 0 == c.existing_decode_tokens
    handle.info = {}
    assert handle.candidate().max_active == 1


def test_worker_handle_submit_when_not_ready_fails_the_stream():
    handle = WorkerHandle(InferenceDevice("cpu", None, 1, "cpu"), {})
    handle.state, handle.error = "dead", "worker cpu exited (exit code -9)"
    stream = RequestStream("r1", None, [1, 2, 3])
    handle.submit(stream, [1, 2, 3], SamplingParams(max_tokens=4), 0)
    assert stream.finished and stream.finish_reason == "error" and "worker cpu is dead" in stream.error
    assert handle.in_flight == {} and handle.counters["routed"] == 0
    events = list(stream)
    assert len(events) == 1 and events[0].finished


def test_a_splits_decode_half_is_in_its_decode_workers_ledger_from_the_split_on():
    """The router must see a split's decode half on B before B imports it: a burst priced
    B as idle once per request and sent two splits and two whole requests to one CPU."""
    handle = WorkerHandle(InferenceDevice("cpu", None, 1, "cpu#2"), {})
    handle.state, handle.info = "ready", {"max_active_requests": 4}
    handle.expect("s1", 9, 127, context_tokens=4097)
    c = handle.candidate()
    assert (c.active, c.queued, c.queued_work) == (0, 1, [[9, 127]])
    assert (c.existing_prefill_tokens, c.existing_decode_tokens) == (9, 127)
    assert (c.arriving, c.context_tokens) == (1, 4097)  # it lands with its prompt's K/V
    handle.forget("s1")
    assert handle.candidate().queued == 0
    handle.expect("s2", 9, 127)
    handle._mark_down("dead", "worker cpu#2 exited")  # its expected halves go with it
    assert handle.expected == {}
