"""The rates' context term (worker_rates.py): a decode step's time grows with the K/V its
rows read, and the cost router prices a request's decode at the context it would hold.

References are exact arithmetic written out here from the documented model
step_s(b, C) = b / decode_rate(b) + context_s * max(0, C - b * calibration_context),
and the documented counting rule for a worker's running contexts.
"""

from __future__ import annotations

import json
import math

import pytest

from minivllm.errors import ConfigError
from minivllm.serving.inference_devices import parse_inference_devices
from minivllm.serving.request_stream import RequestStream
from minivllm.serving.router import Candidate, IncomingRequest, Router
from minivllm.serving.worker_handle import InFlight, WorkerHandle
from minivllm.serving.worker_rates import ALPHA, WorkerRates, load_profile


def rel(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


def test_step_time_adds_the_context_beyond_calibration():
    r = WorkerRates(prefill_tps=100.0, decode_points={1: 20.0, 4: 40.0}, context_s=1e-5, calibration_context=128)
    assert rel(r.decode_step_s(1), 1 / 20)  # no context given: as calibrated
    assert rel(r.decode_step_s(1, 4096), 1 / 20 + 1e-5 * (4096 - 128))
    assert rel(r.decode_step_s(4, 4 * 1000), 4 / 40 + 1e-5 * (4000 - 512))
    assert rel(r.decode_step_s(4, 100), 4 / 40)  # shorter than calibrated: no discount
    assert WorkerRates(prefill_tps=1.0).decode_step_s(1, 10) is None


def test_a_decode_step_as_the_context_term_predicts_corrects_nothing():
    r = WorkerRates(prefill_tps=100.0, decode_points={1: 20.0}, context_s=1e-5, calibration_context=128)
    predicted = 1 / 20 + 1e-5 * (4096 - 128)
    for _ in range(5):
        r.observe_step(0, 1, predicted, 4096)
    assert rel(r.decode_correction_at(1), 1.0)
    # without the context the same steps look like a slower batch curve
    blind = WorkerRates(prefill_tps=100.0, decode_points={1: 20.0}, context_s=1e-5, calibration_context=128)
    blind.observe_step(0, 1, predicted)
    assert rel(blind.decode_correction_at(1), (1 - ALPHA) + ALPHA * (1 / predicted) / 20)


def test_the_context_term_round_trips_and_a_bad_one_is_refused(tmp_path):
    r = WorkerRates(prefill_tps=100.0, decode_points={1: 20.0}, source="calibration", context_s=3e-6,
                    calibration_context=128)
    back = WorkerRates.from_dict(json.loads(json.dumps(r.as_dict())))
    assert (back.context_s, back.calibration_context) == (3e-6, 128)
    old = WorkerRates.from_dict({"prefill_tps": 1.0, "decode_tps": {"1": 2.0}})  # a record from before the term
    assert (old.context_s, old.calibration_context) == (0.0, 0)
    path = tmp_path / "rates.json"
    path.write_text(json.dumps({"workers": {"cpu": {"prefill_tps": 1.0, "decode_tps": {"1": 2.0}, "context_s": -1}}}))
    with pytest.raises(ConfigError) as exc:
        load_profile(path, "cpu")
    assert "context term" in str(exc.value)


def _candidate(name: str, **kw) -> Candidate:
    base = dict(worker=name, healthy=True, active=0, queued=0, existing_prefill_tokens=0, existing_decode_tokens=0,
                max_active=4)
    base.update(kw)
    return Candidate(**base)


def test_the_router_prices_decode_at_the_incoming_requests_context():
    # Two workers equal at calibration; "cpu" pays 20 us a step per token of context, "gpu" nothing.
    rates = {"cpu": WorkerRates(prefill_tps=1e6, decode_points={1: 30.0}, context_s=2e-5, calibration_context=128),
             "gpu": WorkerRates(prefill_tps=1e6, decode_points={1: 29.0}, calibration_context=128)}
    router = Router("cost")
    short = router.choose(IncomingRequest("s", prompt_tokens=64, max_tokens=64),
                          [_candidate("cpu"), _candidate("gpu")], rates)
    assert short["chosen"] == "cpu"  # 64 + 32 tokens of context: below calibration, no term
    long = router.choose(IncomingRequest("l", prompt_tokens=4096, max_tokens=128),
                         [_candidate("cpu"), _candidate("gpu")], rates)
    assert long["chosen"] == "gpu"
    cpu = next(c for c in long["candidates"] if c["worker"] == "cpu")
    assert cpu["decode_context"] == 4096 + 64
    step = 1 / 30 + 2e-5 * (4096 + 64 - 128)
    assert rel(cpu["decode_tps"], 1 / step)
    assert rel(cpu["finish_s"], 4096 / 1e6 + 128 * step)


def test_decode_context_counts_the_running_rows_that_would_decode_beside_it():
    rates = {"w": WorkerRates(prefill_tps=1e6, decode_points={1: 10.0, 4: 40.0}, context_s=1e-5,
                              calibration_context=100)}
    incoming = IncomingRequest("r", prompt_tokens=1000, max_tokens=200)
    # two running rows of 3000 tokens in all, a free slot for the incoming one: all three decode together
    two = _candidate("w", active=2, context_tokens=3000, active_work=[[0, 50], [0, 50]])
    record = Router("cost").choose(incoming, [two], rates)
    c = record["candidates"][0]
    assert c["concurrency"] == 3 and c["decode_context"] == 3000 + 1000 + 100
    assert rel(c["decode_tps"], 3 / (3 / 30.0 + 1e-5 * (4100 - 300)))
    # six running (slots full): the incoming one decodes beside three of them, at their mean context
    six = _candidate("w", active=6, max_active=4, context_tokens=6000, active_work=[[0, 50]] * 6)
    c = Router("cost").choose(incoming, [six], rates)["candidates"][0]
    assert c["concurrency"] == 4 and c["decode_context"] == 3000 + 1000 + 100


def test_a_split_decode_half_on_its_way_counts_as_a_row_with_its_prompts_context():
    """A burst's second split was priced as if the first one's decode half, already routed
    to B, would read no K/V (h100-s57: priced 4.36 s, took 7.98 s, B decoding both
    4,096-token rows in 60 ms steps). The arriving half is a row with its prompt's context."""
    rates = {"b": WorkerRates(prefill_tps=1e6, decode_points={1: 10.0, 2: 20.0}, context_s=1e-5,
                              calibration_context=100)}
    incoming = IncomingRequest("r", prompt_tokens=4096, max_tokens=128)
    idle = Router("cost").choose(incoming, [_candidate("b")], rates)["candidates"][0]
    assert idle["concurrency"] == 1 and idle["decode_context"] == 4096 + 64
    arriving = _candidate("b", queued=1, arriving=1, context_tokens=4097, queued_work=[[1, 127]],
                          existing_prefill_tokens=1, existing_decode_tokens=127)
    c = Router("cost").choose(incoming, [arriving], rates)["candidates"][0]
    assert c["concurrency"] == 2 and c["decode_context"] == 4097 + 4096 + 64
    assert rel(c["decode_tps"], 2 / (2 / 20.0 + 1e-5 * (4097 + 4096 + 64 - 200)))


def test_worker_handle_sums_the_running_requests_contexts():
    handle = WorkerHandle(parse_inference_devices(["cpu"])[0], {})
    handle.state, handle.info = "ready", {"max_active_requests": 4}

    def flight(rid, prompt, max_tokens, output=0):
        return rid, InFlight(RequestStream(rid, None, list(range(prompt))), prompt, 0, max_tokens, output_tokens=output)

    handle.in_flight = dict([flight("decoding", 300, 50, output=20),  # 320 of context
                             flight("prefilling", 500, 10),  # running: its prompt
                             flight("queued", 700, 10)])  # not running: no K/V yet
    handle.running = {"prefilling": 100}
    assert handle.candidate().context_tokens == 320 + 500
