"""Fault drills against real worker processes (SmolLM2-135M, two one-thread CPU workers).

- `kill -9` of one worker in the middle of a burst of HTTP streams (automatic restarts
  off): the dead worker's streams end with an error chunk within 5 s, every other stream
  finishes normally, `/health` says which worker is dead, the router sends nothing more
  to it, and the restart route brings it back while the survivor keeps serving.
- Self-healing: a worker killed with SIGKILL, a frozen process (SIGSTOP: no heartbeat)
  and a hung step loop (heartbeat still going) are detected (the last two by their
  timeouts), their requests fail naming the worker, the cause and the restart, the dead
  process is reaped, new requests go to the other worker meanwhile, and the worker is
  back by itself within 30 s, counted in the snapshot and on /metrics, and routed to again.

References: the request ledger (`Cluster.snapshot()["requests"]`: one terminal event per
request, none open), the survivors' own fresh engine snapshots (no running request,
every page free or cached-idle), the process table (/proc), the router's own decision
records (which candidates were healthy) and the Prometheus text. Time limits are the
issue's targets (5 s, 30 s) or liveness deadlines.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from urllib.parse import quote

import httpx
import pytest

from minivllm.sampling.sampling_params import SamplingParams
from minivllm.serving import Cluster
from minivllm.serving.http_server import start_server_in_background
from minivllm.serving.metrics import ServingMetrics

KEY = "drill-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 256
SURVIVOR_MAX_MODEL_LEN = 2048
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def profile_file(tmp_path, names=("cpu", "cpu#2")):
    # Rates from a profile: calibrating two workers (and again on restart) only costs time here.
    path = tmp_path / "rates.json"
    path.write_text(json.dumps({"workers": {n: {"prefill_tps": 100.0, "decode_tps": {"1": 15.0, "4": 40.0}}
                                            for n in names}}))
    return str(path)


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.02)


def assert_idle_and_accounted(cluster, workers):
    """Nothing open in the ledger, no duplicate terminal, and each named worker idle with
    every page free or cached-idle."""
    def idle():
        snap = cluster.snapshot(fresh=True)
        ok = snap["requests"]["open"] == 0
        for w in snap["workers"]:
            if w["name"] in workers:
                kv, q = w["snapshot"]["kv"], w["snapshot"]["queues"]
                ok &= not (q["running"] or q["waiting"] or q["preempted"])
                ok &= kv["available_pages"] + kv["reserved_pages"] == kv["total_pages"]
                ok &= not w["in_flight"]
        return ok
    wait_for(idle, 30, "the workers to go idle with all pages back")
    ledger = cluster.snapshot()["requests"]
    assert ledger["duplicate_terminals"] == 0 and ledger["submitted"] == sum(ledger["ended"].values()), ledger


async def stream_one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, first_token: asyncio.Event):
    """One streaming completion; returns (request id, how it ended, end time, completion tokens)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    rid, tokens, ending = None, None, None
    async with client.stream("POST", url + "/v1/completions", json=body, headers=AUTH) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                ending = ending or "done-without-finish"
                break
            payload = json.loads(data)
            if "error" in payload:
                ending = ("error", payload["error"]["message"])
                break
            rid = payload["id"]
            first_token.set()
            if payload.get("usage"):
                tokens = payload["usage"]["completion_tokens"]
            elif payload["choices"][0]["finish_reason"] is not None:
                ending = ("finished", payload["choices"][0]["finish_reason"])
    return rid, ending, time.monotonic(), tokens


@pytest.mark.parametrize("devices, survivor_name, victim_name, max_tokens", [
    (["cpu:1", "cpu:1"], "cpu", "cpu#2", 120),
    # A GPU worker dies with a CUDA context and graphs; its streams are fast, so longer.
    pytest.param(["cpu:2", "cuda:0"], "cpu", "cuda:0", 400, marks=pytest.mark.cuda),
], ids=["cpu-cpu", "cpu-cuda"])
def test_kill_9_mid_burst_over_http(smollm2_path, tmp_path, devices, survivor_name, victim_name, max_tokens):
    with Cluster(str(smollm2_path), devices, router="round-robin", max_model_len=max(MAX_MODEL_LEN, max_tokens + 64),
                 rates_profile=profile_file(tmp_path, (survivor_name, victim_name)), max_worker_restarts=0) as cluster:
        srv = start_server_in_background(cluster, api_key=KEY)
        try:
            prompts = [f"Story number {i}: once upon a time" for i in range(8)]

            async def drill():
                async with httpx.AsyncClient(timeout=120) as client:
                    started = [asyncio.Event() for _ in prompts]
                    tasks = [
                        asyncio.create_task(stream_one(client, srv.url, p, max_tokens, e))
                        for p, e in zip(prompts, started)
                    ]
                    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
                    holding = {
                        w["name"]: {f["request_id"] for f in w["in_flight"]} for w in cluster.snapshot()["workers"]
                    }
                    victim_pid = cluster.workers[victim_name].transport.pid
                    os.kill(victim_pid, signal.SIGKILL)  # kill -9, as the OOM killer or a user would
                    killed_at = time.monotonic()
                    return holding, killed_at, await asyncio.gather(*tasks)

            holding, killed_at, results = asyncio.run(drill())
            assert holding[survivor_name] and holding[victim_name], (
                f"round-robin should have used both workers: {holding}"
            )
            errors = 0
            for rid, ending, ended_at, tokens in results:
                if rid in holding[victim_name] and ending[0] == "error":
                    errors += 1
                    assert victim_name in ending[1] and "killed by SIGKILL" in ending[1], ending
                    assert "automatic restarts are off" in ending[1], ending
                    assert ended_at - killed_at < 5.0, (
                        f"{rid} got its error {ended_at - killed_at:.1f} s after the kill"
                    )
                else:
                    # A survivor's stream, or a victim's that completed before the kill landed
                    # (a fast machine can finish one between the snapshot and the signal).
                    assert ending == ("finished", "length") and tokens == max_tokens, (rid, ending, tokens)
            assert errors >= 1, "no stream of the killed worker was still running at the kill"

            health = httpx.get(srv.url + "/health").json()
            assert health["status"] == "degraded"
            assert {w["name"]: w["state"] for w in health["workers"]} == {survivor_name: "ready", victim_name: "dead"}
            after = [httpx.post(srv.url + "/v1/completions", headers=AUTH, timeout=60,
                                json={"prompt": f"Count to {i}:", "max_tokens": 3}).json() for i in range(4)]
            assert [a["minivllm"]["worker"] for a in after] == [survivor_name] * 4  # round-robin skips the dead one

            restarted = httpx.post(srv.url + f"/v1/cluster/workers/{quote(victim_name, safe='')}/restart",
                                   headers=AUTH, timeout=300)
            assert restarted.status_code == 200 and restarted.json()["status"] == "ok", restarted.text
            assert httpx.post(srv.url + "/v1/cluster/workers/nope/restart", headers=AUTH).status_code == 404
            back = [httpx.post(srv.url + "/v1/completions", headers=AUTH, timeout=60,
                               json={"prompt": f"Name {i} colours:", "max_tokens": 3}).json() for i in range(2)]
            assert {b["minivllm"]["worker"] for b in back} == {survivor_name, victim_name}
            assert_idle_and_accounted(cluster, {survivor_name, victim_name})
        finally:
            srv.stop()


def survivor_budget(cluster, worker: str, outlast_s: float, max_tokens: int) -> int:
    """A token budget that keeps `worker` generating for well over `outlast_s`, from its rate
    measured here: a fixed length would measure the machine's speed instead (a fast CPU
    finished 200 tokens before a hung worker was even detected)."""
    probe = cluster.submit("Counting sheep: one, two,", SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
                           worker=worker).result(120)
    rate = probe.metrics.decode_tokens_per_s
    assert rate > 0, probe.metrics
    # x3: the survivor speeds up once the victim stops competing for the cores.
    return int(min(max_tokens, max(200, 3 * rate * outlast_s)))


@pytest.mark.parametrize("fault, cause", [("crash", "killed by SIGKILL"), ("freeze", "sent nothing"),
                                          ("hang", "step loop has not turned")])
def test_a_dead_or_hung_worker_restarts_by_itself(smollm2_path, tmp_path, fault, cause):
    timeout_s = 3.0
    with Cluster(str(smollm2_path), ["cpu:1", "cpu:1"], router="round-robin", max_model_len=SURVIVOR_MAX_MODEL_LEN,
                 rates_profile=profile_file(tmp_path), heartbeat_timeout_s=timeout_s, stall_timeout_s=timeout_s,
                 fault_injection=True) as cluster:
        # Outlast the detection (the timeout plus a heartbeat or two) and the kill.
        budget = survivor_budget(cluster, "cpu", outlast_s=timeout_s + 5.0, max_tokens=SURVIVOR_MAX_MODEL_LEN - 64)
        long = SamplingParams(temperature=0.0, max_tokens=budget, ignore_eos=True)
        survivor = cluster.submit("The history of the bicycle", long, worker="cpu")
        victim = cluster.submit("The history of the telescope", LONG, worker="cpu#2")
        wait_for(lambda: victim.token_ids and survivor.token_ids, 60, "first tokens")
        pid = cluster.workers["cpu#2"].transport.pid
        if fault == "crash":
            os.kill(pid, signal.SIGKILL)
        else:
            cluster.inject_fault("cpu#2", fault)
        faulted_at = time.monotonic()
        survivor_at_fault = len(survivor.token_ids)
        out = victim.result(30.0)
        detected_after = time.monotonic() - faulted_at
        assert out.finish_reason == "error" and cause in victim.error and "cpu#2" in victim.error, victim.error
        assert "restarting it automatically" in victim.error, victim.error
        # Never before the timeout; the upper bounds are liveness deadlines, not speed tests.
        if fault == "crash":
            assert detected_after < 5.0, detected_after
        else:
            assert timeout_s - 0.5 < detected_after < timeout_s + 10.0, detected_after
        # Reaped: not even a zombie is left of it, whatever comes next.
        wait_for(lambda: not os.path.exists(f"/proc/{pid}"), 10, "the dead process to be reaped")

        # While it is down or loading, round-robin sends everything to the survivor.
        meanwhile = [
            cluster.submit(f"Name {i} animals:", SamplingParams(temperature=0.0, max_tokens=4)) for i in range(2)
        ]
        skipped = 0
        for stream in meanwhile:
            healthy = {c["worker"]: c["healthy"] for c in stream.decision["candidates"]}
            if not healthy["cpu#2"]:
                skipped += 1
                assert stream.worker == "cpu", stream.decision
        assert skipped >= 1, "the worker was back before any request could be routed around it"
        assert all(s.result(120).finish_reason in ("stop", "length") and s.error is None for s in meanwhile)

        def restarts():
            return next(w["restarts"] for w in cluster.snapshot()["workers"] if w["name"] == "cpu#2")

        wait_for(lambda: cluster.health()["status"] == "ok", 30.0 - (time.monotonic() - faulted_at),
                 "the worker to be back within 30 s of the fault")
        back_after = time.monotonic() - faulted_at
        print(f"{fault}: detected after {detected_after:.1f} s, back after {back_after:.1f} s")
        wait_for(lambda: restarts()["state"] == "up", 10, "the supervisor to see it back")
        assert cluster.workers["cpu#2"].transport.pid != pid
        counted = restarts()
        assert (counted["state"], counted["automatic"], counted["failed"], counted["manual"]) == ("up", 1, 0, 0)
        assert cause in counted["last_cause"]
        metrics = ServingMetrics(cluster).render().decode()
        assert 'minivllm_worker_restarts_total{kind="automatic",worker="cpu#2"} 1.0' in metrics
        assert 'minivllm_worker_restarts_total{kind="automatic",worker="cpu"} 0.0' in metrics

        # Routed to again once it is back.
        again = [cluster.submit(f"Name {i} rivers:", SamplingParams(temperature=0.0, max_tokens=4)) for i in range(2)]
        assert {s.worker for s in again} == {"cpu", "cpu#2"}
        assert all(s.result(60).finish_reason in ("stop", "length") and s.error is None for s in again)
        # The survivor was not disturbed: no error, tokens still arriving after the fault,
        # and its full length at the end.
        done = survivor.result(300)
        assert survivor.error is None and done.finish_reason == "length", (done.finish_reason, survivor.error)
        assert survivor_at_fault < len(done.token_ids) == budget
        assert_idle_and_accounted(cluster, {"cpu", "cpu#2"})


def test_hang_needs_fault_injection(smollm2_path, tmp_path):
    from minivllm.errors import ConfigError

    with Cluster(str(smollm2_path), ["cpu:1"], max_model_len=MAX_MODEL_LEN,
                 rates_profile=profile_file(tmp_path, ("cpu",))) as cluster:
        with pytest.raises(ConfigError, match="fault_injection=True"):
            cluster.inject_fault("cpu", "hang")
        with pytest.raises(ConfigError, match="crash, freeze, hang"):
            cluster.inject_fault("cpu", "meteor")

