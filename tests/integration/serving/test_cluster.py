"""`Cluster`: real worker processes serving the real SmolLM2-135M on the CPU.

Reference: the in-process single engine (`minivllm.LLM`, same model, same
max_model_len), run one request at a time. Whatever worker a request lands on, and
however it is streamed, its greedy tokens must be the reference's.

Both sides run with batch_invariant=True. Without it a row's floats depend on what it
is batched with and on where its pages sit in the pool (non-consecutive pages are
attended run by run, which sums in another order; a worker's pool layout depends on
everything it served before), and a near-tie flips a greedy token: SmolLM2's 17th
token after "In 1969, Neil Armstrong ..." is 9016 in a fresh engine and 8421 after two
other requests left their pages in the prefix cache. Invariant mode makes each row's
arithmetic depend on its own tokens only, so exact equality is the right check.

One two-worker cluster is shared by the serving tests; tests that kill workers or need
other options start their own and come first, so their processes never run next to the
shared cluster's (which starts with the first test that asks for it). Time limits here
are liveness deadlines only.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import pytest
from conftest import DATA_DIR

from minivllm import LLM, SamplingParams
from minivllm.errors import ConfigError, ModelSourceError
from minivllm.serving import Cluster
from minivllm.serving.cluster import SCHEMA, WorkerStartError
from minivllm.serving.router import NoWorkerAvailable

MAX_MODEL_LEN = 512
PROMPTS = json.loads((DATA_DIR / "prompts.json").read_text())["prompts"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
DEADLINE_S = 120.0  # liveness only: a request that never ends fails instead of hanging

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def reference(smollm2_path):
    return LLM(str(smollm2_path), max_model_len=MAX_MODEL_LEN, progress=False, batch_invariant=True)


_ref_cache: dict = {}


def ref_output(reference: LLM, prompt, params: SamplingParams):
    """The output of one request alone in the in-process engine."""
    key = (str(prompt), repr(params))
    if key not in _ref_cache:
        (_ref_cache[key],) = reference.generate([prompt], params)
    return _ref_cache[key]


def ref_tokens(reference: LLM, prompt, params: SamplingParams) -> list[int]:
    return ref_output(reference, prompt, params).token_ids


@pytest.fixture(scope="module")
def cluster(smollm2_path):
    # round-robin needs no rates: skip the start-up calibration (row-by-row invariant prefills make it slow)
    c = Cluster(str(smollm2_path), ["cpu:1", "cpu:1"], router="round-robin", max_model_len=MAX_MODEL_LEN,
                calibrate=False, batch_invariant=True)
    c.start()
    try:
        yield c
    finally:
        c.stop()


def wait_idle(cluster: Cluster, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while any(h.in_flight for h in cluster.workers.values()):
        assert time.monotonic() < deadline, {h.name: list(h.in_flight) for h in cluster.workers.values()}
        time.sleep(0.05)


def worker_named(text: str, name: str) -> bool:
    """`name` appears as a whole worker name ("cpu" must not match inside "cpu#2")."""
    return re.search(rf"(?<![\w#]){re.escape(name)}(?![\w#:])", text) is not None


# -- configuration errors ------------------------------------------------------------------------------


def test_invalid_options_fail_before_any_process(smollm2_path, tmp_path, monkeypatch):
    import subprocess

    def no_process(*a, **k):
        raise AssertionError("a worker process was started")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    with pytest.raises(ConfigError) as exc:
        Cluster(str(smollm2_path), ["cpu"], page_size=0)
    assert exc.value.field == "page_size" and "page_size" in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        with Cluster(str(smollm2_path), ["cpu"], max_active_requests=0):
            pass
    assert exc.value.field == "max_active_requests"
    with pytest.raises(ConfigError) as exc:
        Cluster(str(smollm2_path), ["cpu", "tpu"])
    assert exc.value.field == "inference_device" and exc.value.value == "tpu"
    with pytest.raises(ConfigError) as exc:
        Cluster(str(smollm2_path), ["cpu"], router="fastest")
    assert exc.value.field == "router"
    missing = tmp_path / "no-such-model.gguf"
    with pytest.raises(ModelSourceError, match="does not exist") as exc:
        Cluster(str(missing), ["cpu"])
    assert str(missing) in str(exc.value)
    monkeypatch.setenv("MINIVLLM_EXPORT_ZERO_COPY", "yes")  # the split's export path: 0 or 1
    with pytest.raises(ConfigError, match="set it to 1") as exc:
        Cluster(str(smollm2_path), ["cpu", "cpu"])
    assert exc.value.field == "MINIVLLM_EXPORT_ZERO_COPY" and exc.value.value == "yes"
    monkeypatch.delenv("MINIVLLM_EXPORT_ZERO_COPY")
    idle = Cluster(str(smollm2_path), ["cpu"])
    with pytest.raises(ConfigError) as exc:
        idle.submit("hi")
    assert exc.value.field == "cluster"


def test_worker_start_failure_names_worker_and_cause(smollm2_path, tmp_path):
    profile = tmp_path / "missing-rates.json"
    cluster = Cluster(str(smollm2_path), ["cpu:1"], router="cost", max_model_len=128, rates_profile=str(profile))
    with pytest.raises(WorkerStartError) as exc:
        cluster.start()
    message = str(exc.value)
    assert worker_named(message, "cpu") and str(profile) in message and "rates_profile" in message
    assert cluster.health()["status"] == "down" and not cluster.started


# -- faults ------------------------------------------------------------------------------------------


def test_worker_killed_mid_stream(smollm2_path, reference, tmp_path):
    long = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=4)
    # Rates from a profile instead of the start-up calibration: a batch-invariant
    # prefill runs row by row, which would make calibrating (twice, with the restart) slow.
    profile = tmp_path / "rates.json"
    profile.write_text(json.dumps({"workers": {name: {"prefill_tps": 100.0, "decode_tps": {"1": 15.0, "4": 40.0}}
                                               for name in ("cpu", "cpu#2")}}))
    # heartbeat_timeout_s: the survivor's process is held with SIGSTOP below, and a held
    # worker must not be declared dead for its silence meanwhile.
    with Cluster(str(smollm2_path), ["cpu:1", "cpu:1"], router="cost", max_model_len=MAX_MODEL_LEN,
                 rates_profile=str(profile), batch_invariant=True, heartbeat_timeout_s=600.0,
                 max_worker_restarts=0) as cluster:  # the dead worker stays dead until restart_worker
        assert all(h.rates.known and h.rates_wire["source"] == "profile" for h in cluster.workers.values())
        victim = cluster.submit(PROMPTS[0], long, worker="cpu")
        survivor = cluster.submit(PROMPTS[1], long, worker="cpu#2")
        assert (victim.worker, survivor.worker) == ("cpu", "cpu#2")
        deadline = time.monotonic() + 60
        while not (victim.token_ids and survivor.token_ids):
            assert time.monotonic() < deadline, "no first tokens"
            time.sleep(0.02)
        victim_pid = cluster.workers["cpu"].transport.pid
        # Hold the survivor mid-generation (SIGSTOP) from before the kill until the routing
        # checks below are done: they need it still running, and how far a running one got
        # meanwhile (or whether the short requests routed to it finished) would measure
        # this machine's speed. Resumed, it must still end with every token.
        survivor_pid = cluster.workers["cpu#2"].transport.pid
        os.kill(survivor_pid, signal.SIGSTOP)
        try:
            survivor_at_kill = len(survivor.token_ids)
            cluster.kill_worker("cpu")
            killed_at = time.monotonic()
            out = victim.result(10.0)  # liveness: the error event arrives within 10 s
            assert time.monotonic() - killed_at < 10.0
            assert out.finish_reason == "error" and worker_named(victim.error, "cpu"), victim.error
            assert len(out.token_ids) < 300
            assert survivor_at_kill < 300 and not survivor.finished
            health = cluster.health()
            assert health["status"] == "degraded"
            assert {w["name"]: w["state"] for w in health["workers"]} == {"cpu": "dead", "cpu#2": "ready"}
            with pytest.raises(NoWorkerAvailable, match="cpu"):
                cluster.submit(PROMPTS[2], short, worker="cpu")

            # the next requests all go to the survivor (still busy), and the records say why
            more = [cluster.submit(p, short) for p in PROMPTS[2:5]]
            for k, s in enumerate(more):
                assert s.worker == "cpu#2"
                cands = {c["worker"]: c for c in s.decision["candidates"]}
                assert set(cands) == {"cpu", "cpu#2"}
                assert cands["cpu"]["healthy"] is False and cands["cpu"]["score"] is None
                assert cands["cpu#2"]["healthy"] is True and cands["cpu#2"]["score"] > 0
                # the survivor (producing tokens: active) plus the k short ones routed before
                # this one (held, so none can have finished)
                mine = cands["cpu#2"]
                assert mine["active"] >= 1 and mine["active"] + mine["queued"] == 1 + k, mine
                assert mine["concurrency"] == 2 + k
                assert 4 * k < mine["existing_decode_tokens"] <= 300 + 4 * k
                assert mine["incoming_decode_tokens"] == 4
                assert s.decision["policy"] == "cost" and s.decision["reason"] == "cost"
        finally:
            os.kill(survivor_pid, signal.SIGCONT)

        # nobody on the survivor was disturbed (the references are computed meanwhile)
        expected = ref_tokens(reference, PROMPTS[1], long)
        for p, s in zip(PROMPTS[2:5], more):
            assert s.result(DEADLINE_S).token_ids == ref_tokens(reference, p, short)
        done = survivor.result(DEADLINE_S)
        assert done.finish_reason == "length" and done.token_ids == expected and len(expected) == 300

        cluster.restart_worker("cpu")
        assert cluster.health()["status"] == "ok"
        assert cluster.workers["cpu"].transport.pid != victim_pid
        back = cluster.submit(PROMPTS[5], short, worker="cpu")
        assert back.worker == "cpu"
        assert back.result(DEADLINE_S).token_ids == ref_tokens(reference, PROMPTS[5], short)

        # every worker down: nothing can be routed
        for name in ("cpu", "cpu#2"):
            cluster.kill_worker(name)
        deadline = time.monotonic() + 10
        while cluster.health()["status"] != "down":
            assert time.monotonic() < deadline, cluster.health()
            time.sleep(0.05)
        with pytest.raises(NoWorkerAvailable):
            cluster.submit(PROMPTS[6], short)


# -- serving ---------------------------------------------------------------------------------------


def test_two_workers_serve_concurrent_requests(cluster, reference):
    assert [h.name for h in cluster.workers.values()] == ["cpu", "cpu#2"]
    assert all(h.state == "ready" and h.device.threads == 1 for h in cluster.workers.values())
    prompts = PROMPTS[0:4]
    streams = [cluster.submit(p, GREEDY) for p in prompts]
    workers = [s.worker for s in streams]
    assert sorted(workers) == ["cpu", "cpu", "cpu#2", "cpu#2"]
    assert workers[0] != workers[1] and workers[2] != workers[3] and workers[0] == workers[2]
    outs = [s.result(DEADLINE_S) for s in streams]
    for prompt, s, out in zip(prompts, streams, outs):
        expected = ref_output(reference, prompt, GREEDY)
        assert out.token_ids == expected.token_ids, (s.worker, prompt, out.token_ids, expected.token_ids)
        assert out.text == expected.text and out.finish_reason == expected.finish_reason
        assert out.prompt_token_ids == reference.tokenizer.encode(prompt) == expected.prompt_token_ids
        assert out.metrics.output_tokens == len(expected.token_ids)
        assert out.metrics.prompt_tokens == len(expected.prompt_token_ids)
    wait_idle(cluster)


def test_streaming_events_match_final_output(cluster, reference):
    params = SamplingParams(temperature=0.0, max_tokens=20)
    stream = cluster.submit(PROMPTS[4], params)
    events = list(stream)
    assert sum(e.finished for e in events) == 1 and events[-1].finished
    assert "".join(e.text for e in events) == stream.text
    assert [e.token_id for e in events if e.token_id >= 0] == stream.token_ids
    out = stream.result(1.0)
    expected = ref_output(reference, PROMPTS[4], params)
    assert out.token_ids == expected.token_ids and out.text == expected.text
    assert out.finish_reason == events[-1].finish_reason == expected.finish_reason
    assert stream.result(0.1).token_ids == expected.token_ids


def test_async_for_inside_event_loop(cluster, reference):
    params = SamplingParams(temperature=0.0, max_tokens=10)

    async def consume():
        stream = cluster.submit(PROMPTS[5], params)
        events = [e async for e in stream]
        return stream, events

    stream, events = asyncio.run(asyncio.wait_for(consume(), DEADLINE_S))
    assert sum(e.finished for e in events) == 1 and events[-1].finished
    assert [e.token_id for e in events if e.token_id >= 0] == ref_tokens(reference, PROMPTS[5], params)
    assert "".join(e.text for e in events) == stream.text == ref_output(reference, PROMPTS[5], params).text

    # a stream submitted outside a loop says how to consume it
    plain = cluster.submit(PROMPTS[5], SamplingParams(temperature=0.0, max_tokens=2))

    async def try_async():
        return [e async for e in plain]

    with pytest.raises(RuntimeError, match="outside an event loop"):
        asyncio.run(try_async())
    assert plain.result(DEADLINE_S).finish_reason == "length"


def test_cancel_mid_stream_frees_pages(cluster):
    wait_idle(cluster)
    stream = cluster.submit(PROMPTS[6], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    seen = []
    for event in stream:
        seen.append(event)
        if len(seen) == 3:
            break  # leaving the loop cancels the request
    assert not any(e.finished for e in seen)
    out = stream.result(10.0)
    assert out.finish_reason == "abort" and 3 <= len(out.token_ids) < 200
    snap = cluster.snapshot(fresh=True)
    (w,) = [w for w in snap["workers"] if w["name"] == stream.worker]
    kv, queues = w["snapshot"]["kv"], w["snapshot"]["queues"]
    assert queues["running"] == [] and queues["waiting"] == [] and queues["preempted"] == []
    idle = kv["page_states"].count("cached-idle")
    assert kv["free_pages"] + idle == kv["total_pages"] == len(kv["page_states"]), kv
    assert kv["page_states"].count("free") == kv["free_pages"] and kv["available_pages"] == kv["total_pages"]
    assert set(kv["page_states"]) <= {"free", "cached-idle"}
    assert w["snapshot"]["counters"]["finished_abort"] >= 1
    assert w["in_flight"] == []


def test_bad_requests_are_refused_before_routing(cluster, reference):
    wait_idle(cluster)
    vocab = reference.config.vocab_size
    decisions = cluster.router.counters["decisions"]
    routed = {h.name: h.counters["routed"] for h in cluster.workers.values()}

    def refused(field, prompt, params=None, **kw):
        with pytest.raises(ConfigError) as exc:
            cluster.submit(prompt, params, **kw)
        assert exc.value.field == field, (field, str(exc.value))
        assert field in str(exc.value)
        return exc.value

    err = refused("prompt", [100] * MAX_MODEL_LEN)
    assert "max_model_len=512" in str(err)
    refused("prompt", [100] * (MAX_MODEL_LEN + 100))
    refused("prompt", "hello " * 600)
    err = refused("prompt_token_ids", [1, 2, vocab])
    assert err.value == [vocab]
    refused("prompt_token_ids", [-1, 5])
    refused("prompt", [])
    err = refused("max_tokens", [100] * 500, SamplingParams(max_tokens=13))  # 500 + 13 > 512
    assert err.value == 13
    refused("prompt", "")
    refused("prompt", 12345)
    refused("prompt", [1.5, 2])
    refused("params", "hi", {"max_tokens": 4})
    refused("messages", "hi", messages=[{"role": "user", "content": "hi"}])
    for field, kwargs in [("temperature", {"temperature": -1.0}), ("max_tokens", {"max_tokens": 0}),
                          ("top_p", {"top_p": 0.0}), ("logprobs", {"logprobs": 21})]:
        with pytest.raises(ConfigError) as exc:
            cluster.submit("hi", SamplingParams(**kwargs))
        assert exc.value.field == field
    # the in-process engine refuses the same prompts (same rules, same fields)
    for ids, field in [([100] * MAX_MODEL_LEN, "prompt"), ([1, vocab], "prompt_token_ids"), ([], "prompt")]:
        with pytest.raises(ConfigError) as exc:
            reference.engine.add_request(ids, GREEDY)
        assert exc.value.field == field
    # nothing reached the router or a worker
    assert cluster.router.counters["decisions"] == decisions
    assert {h.name: h.counters["routed"] for h in cluster.workers.values()} == routed
    # the cluster keeps serving
    ok = cluster.submit(PROMPTS[7], GREEDY).result(DEADLINE_S)
    assert ok.token_ids == ref_tokens(reference, PROMPTS[7], GREEDY)
    assert cluster.health()["status"] == "ok"


def test_snapshot_schema_and_decisions(cluster):
    wait_idle(cluster)
    before = len(cluster.router.decisions)
    streams = [cluster.submit(p, SamplingParams(temperature=0.0, max_tokens=3)) for p in PROMPTS[8:11]]
    pinned = cluster.submit(PROMPTS[11], SamplingParams(temperature=0.0, max_tokens=3), worker="cpu#2")
    for s in streams + [pinned]:
        s.result(DEADLINE_S)
    assert pinned.worker == "cpu#2"
    snap = cluster.snapshot(fresh=True)
    assert json.loads(json.dumps(snap)) == snap
    assert snap["schema"] == SCHEMA == "minivllm.cluster.snapshot/1"
    assert snap["health"] == "ok" and snap["model_path"] == str(cluster.model_path)
    assert snap["router"]["policy"] == "round-robin"
    decisions = snap["router"]["decisions"]
    assert len(decisions) == before + 4
    for s in streams + [pinned]:
        mine = [d for d in decisions if d["request_id"] == s.request_id]
        assert len(mine) == 1, s.request_id
        assert mine[0]["chosen"] == s.worker and mine[0] == s.decision
        assert sorted(c["worker"] for c in mine[0]["candidates"]) == ["cpu", "cpu#2"]
        assert all(c["healthy"] for c in mine[0]["candidates"])
    assert sorted(s.worker for s in streams) in (["cpu", "cpu", "cpu#2"], ["cpu", "cpu#2", "cpu#2"])
    (forced,) = [d for d in decisions if d["request_id"] == pinned.request_id]
    assert forced["policy"] == "forced:cpu#2"
    workers = {w["name"]: w for w in snap["workers"]}
    assert set(workers) == {"cpu", "cpu#2"}
    for name, w in workers.items():
        assert w["state"] == "ready" and w["device"] == "cpu" and w["threads"] == 1
        assert w["snapshot"]["schema"] == "minivllm.engine.snapshot/1"
        assert w["snapshot"]["engine"]["max_model_len"] == MAX_MODEL_LEN
        assert w["info"]["name"] == name and w["pid"] == cluster.workers[name].transport.pid
        assert w["rates"]["source"] == "none" and w["rates"]["prefill_tps"] is None  # calibrate=False
        assert w["in_flight"] == []
    finished = {n: w["snapshot"]["counters"]["requests_finished"] for n, w in workers.items()}
    routed = {n: w["counters"]["routed"] for n, w in workers.items()}
    assert finished == routed  # every request routed to a worker ran there (calibration is not counted)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two pinned workers need two CPUs")
def test_pinned_workers_run_on_cpus_of_their_own(smollm2_path):
    from minivllm.serving.cpu_placement import cpus_physical_first

    with Cluster(str(smollm2_path), ["cpu:1", "cpu:1"], max_model_len=128, calibrate=False, pin_cpus=True) as c:
        # what each worker process's own affinity mask says, read inside it
        seen = {name: h.info["cpu_threads"]["cpus"] for name, h in c.workers.items()}
    order = cpus_physical_first()
    assert seen == {"cpu": [order[0]], "cpu#2": [order[1]]}
