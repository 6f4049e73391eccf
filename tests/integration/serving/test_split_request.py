"""Split requests through the Cluster API (issue 43): prefill and the first token on one
worker process, decode on another, the K/V written straight into the decode worker's
reserved pages (kv_landing.py), or, where that pool cannot be mapped, through a
shared-memory segment.

References:
- the cost+split router's choice: made-up rates (A prefills fast, B decodes fast) whose
  split score is below either whole placement by hand arithmetic (unit-tested term by
  term in tests/unit/serving/test_split_pricing.py); the client is the HTTP API's SSE;
- split == unsplit: the same request served whole by one worker, in batch-invariant mode
  (a row's numbers do not depend on its batch or chunking, and the imported pages hold the
  bits the decode worker's own prefill would have written), token for token;
- the bytes moved: hand computation from SmolLM2-135M's shape (30 layers, 3 KV heads of 64,
  f32, K and V) times the full pages of the prompt;
- nothing leaks: the workers' own fresh engine snapshots (no request, every page free or
  cached-idle), the request ledger (one terminal event each), and /dev/shm itself;
- a dead worker: the process table (SIGSTOP, then SIGKILL, while the import waits).
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from minivllm.errors import ConfigError
from minivllm.sampling.sampling_params import SamplingParams
from minivllm.serving import Cluster
from minivllm.serving.http_server import start_server_in_background
from minivllm.serving.kv_segment import SEGMENT_PREFIX
from minivllm.serving.metrics import ServingMetrics

pytestmark = pytest.mark.usefixtures("one_torch_thread")
A, B = "cpu", "cpu#2"
KV_BYTES_PER_TOKEN = 30 * 3 * 64 * 4 * 2  # layers x KV heads x head dim x f32 x (K, V)
PROMPT = ("The history of the printing press begins in the fifteenth century, when a goldsmith "
          "in Mainz combined movable metal type, oil-based ink and a screw press. Within fifty years")


def profile_file(tmp_path):
    # Made-up rates (no calibration): A prefills fast and decodes slowly, B the other way
    # round, so the cost router prices a split below either whole placement until the
    # workers' own steps correct the rates.
    path = tmp_path / "rates.json"
    path.write_text(json.dumps({"workers": {A: {"prefill_tps": 1000.0, "decode_tps": {"1": 5.0, "4": 20.0}},
                                            B: {"prefill_tps": 10.0, "decode_tps": {"1": 50.0, "4": 200.0}}}}))
    return str(path)


def segments(cluster) -> list[str]:
    """This cluster's K/V segments in /dev/shm (the segment names carry the cluster's id)."""
    return sorted(p.name for p in Path("/dev/shm").glob(f"{SEGMENT_PREFIX}{cluster.splits.cluster_id}-*"))


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.02)


def assert_idle(cluster):
    """Ledger closed, and both workers' own fresh snapshots show no request and every page
    free or cached-idle."""
    def idle():
        snap = cluster.snapshot(fresh=True)
        ok = snap["requests"]["open"] == 0 and not snap["splits"]["live"]
        for w in snap["workers"]:
            kv, q = w["snapshot"]["kv"], w["snapshot"]["queues"]
            ok &= not (q["running"] or q["waiting"] or q["preempted"]) and not w["in_flight"]
            ok &= kv["available_pages"] + kv["reserved_pages"] == kv["total_pages"]
        return ok
    wait_for(idle, 30, "both workers idle with every page back")
    # No split's decode half is still announced to a worker (WorkerHandle.expect).
    assert all(not handle.expected for handle in cluster.workers.values())
    ledger = cluster.snapshot()["requests"]
    assert ledger["duplicate_terminals"] == 0 and ledger["submitted"] == sum(ledger["ended"].values()), ledger


@pytest.fixture(scope="module")
def cluster(smollm2_path, tmp_path_factory):
    with Cluster(str(smollm2_path), ["cpu:1", "cpu:1"], router="round-robin", max_model_len=256,
                 batch_invariant=True, rates_profile=profile_file(tmp_path_factory.mktemp("rates")),
                 max_worker_restarts=0) as c:
        yield c


def test_the_cost_router_splits_where_its_prices_say_it_pays(cluster):
    # First in the module: the workers have not stepped yet, so their rates are the profile's.
    link = cluster.snapshot()["splits"]["link"]
    assert link["measured_mb_per_s"] > 0 and link["probe_bytes"] == 64 << 20
    print("shared-memory link at start-up:", link)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    cluster.set_router("cost+split")
    srv = start_server_in_background(cluster)
    try:  # through the HTTP API: one SSE stream, one finish, whatever the workers do behind it
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=120,
                          json={"model": cluster.model_name, "prompt": PROMPT, "max_tokens": 16, "temperature": 0,
                                "ignore_eos": True, "stream": True}) as r:
            events = [e for e in r.read().decode().split("\n\n") if e]
    finally:
        srv.stop()
        cluster.set_router("round-robin")
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks].count("length") == 1
    split = chunks[-1]["minivllm"]["split"]
    assert (split["prefill_worker"], split["decode_worker"], split["handed_off"]) == (A, B, True)
    (d,) = [x for x in cluster.snapshot()["router"]["decisions"] if x.get("split")]
    assert d["split"] == {"prefill": A, "decode": B} and d["chosen"] == A, d["reason"]
    best_split = min(c["score"] for c in d["split_candidates"])
    assert {(c["prefill"], c["decode"]) for c in d["split_candidates"]} == {(A, B), (B, A)}
    assert best_split < 0.9 * min(c["score"] for c in d["candidates"])
    whole = cluster.submit(PROMPT, params, worker=B).result(120)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole.text and len(whole.token_ids) == 16


@pytest.mark.parametrize("sampled", [False, True])
def test_split_request_equals_the_whole_request(cluster, sampled):
    params = (SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True) if sampled
              else SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    # A prompt neither worker has cached, split first: B has none of its pages, so A writes
    # every full one. Then the whole request on each worker; A's restores what A computed,
    # the independent reference for what B decoded from the pages A wrote.
    prompt = f"Case {sampled}. {PROMPT}"
    stream = cluster.submit(prompt, params, placement=(A, B))
    events = list(stream)
    out = stream.result(1)
    whole = {w: cluster.submit(prompt, params, worker=w).result(120) for w in (A, B)}
    assert out.finish_reason == "length" and out.error is None
    assert out.token_ids == whole[A].token_ids == whole[B].token_ids
    assert [e.token_id for e in events if e.token_id >= 0] == out.token_ids and sum(e.finished for e in events) == 1
    split = stream.metrics["split"]
    assert (split["prefill_worker"], split["decode_worker"], split["handed_off"]) == (A, B, True)
    # A writes straight into pages B reserved while A prefilled (kv_landing.py); A decodes on
    # while that reservation is on its way, so it may have made more than the first token.
    assert split["transport"] == "landing" and split["landing"]["pages"] > 0
    assert split["tokens_on_prefill_worker"] >= 1
    prompt_tokens = len(stream.prompt_token_ids)
    page = cluster.snapshot()["workers"][0]["snapshot"]["kv"]["page_size"]
    assert split["kv_tokens"] == (prompt_tokens // page) * page > 0  # the prompt's full pages
    assert split["kv_bytes"] == split["kv_tokens"] * KV_BYTES_PER_TOKEN
    assert split["copy_mb_per_s"] > 0 and split["handoff_ms"] > 0
    assert stream.metrics["output_tokens"] == 16 and stream.metrics["prompt_tokens"] == prompt_tokens
    # Both workers served it: B restored the imported pages instead of computing them.
    assert split["decode_metrics"]["cached_prompt_tokens"] == split["kv_tokens"]
    assert stream.decision["split"] == {"prefill": A, "decode": B}
    assert segments(cluster) == []
    assert_idle(cluster)


def test_a_pool_the_prefill_worker_cannot_map_sends_the_kv_through_a_segment(cluster, monkeypatch):
    # The landing B sent names a descriptor that is not B's pool (fd 9999 of B's pid), as
    # a hardened /proc would refuse the real one: A's write fails, the segment carries the
    # K/V, and B gives its reservation back at the import.
    from minivllm.serving.split_request import SplitRequest

    reserved = SplitRequest.reserved

    def tampered(self, msg):
        landing = msg.get("landing")
        if landing is not None:
            msg = {**msg, "landing": {**landing, "pool": {**landing["pool"], "fd": 9999}}}
        reserved(self, msg)

    monkeypatch.setattr(SplitRequest, "reserved", tampered)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = f"Unmappable. {PROMPT}"
    stream = cluster.submit(prompt, params, placement=(A, B))
    out = stream.result(120)
    monkeypatch.undo()
    whole = cluster.submit(prompt, params, worker=A).result(120)
    assert out.finish_reason == "length" and out.token_ids == whole.token_ids
    split = stream.metrics["split"]
    assert split["transport"] == "segment" and split["landing"]["pages"] > 0
    assert "gone" in split["landing_error"], split["landing_error"]
    assert segments(cluster) == []
    assert_idle(cluster)


def test_a_request_whose_state_cannot_move_is_refused(cluster):
    with pytest.raises(ConfigError, match="stop"):
        cluster.submit(PROMPT, SamplingParams(max_tokens=8, stop=["."]), placement=(A, B))
    with pytest.raises(ConfigError, match="two different workers"):
        cluster.submit(PROMPT, SamplingParams(max_tokens=8), placement=(A, A))
    with pytest.raises(ConfigError, match="workers: cpu, cpu#2"):
        cluster.submit(PROMPT, SamplingParams(max_tokens=8), placement=(A, "cuda:0"))


def test_200_split_requests_with_a_fifth_cancelled_leave_nothing_behind(cluster):
    rng = random.Random(43)
    words = PROMPT.split()
    done: list = []
    cancelled: set[str] = set()

    def consume(stream, stop_at):
        # Cancel at token `stop_at`: 1 is A's token, which arrives as the K/V moves; 3-6 are B's.
        seen = 0
        for event in stream:
            seen += event.token_id >= 0
            if seen == stop_at:
                stream.cancel()
                break
        done.append(stream)

    for wave in range(10):
        threads = []
        for i in range(20):
            prompt = " ".join(words[: rng.randint(20, 30)]) + f" ({wave}.{i})"
            stream = cluster.submit(prompt, SamplingParams(temperature=0.0, max_tokens=rng.randint(8, 16),
                                                           ignore_eos=True), placement=(A, B))
            how = rng.choice(["now", "soon", "first-token", "first-token", "decode"]) if rng.random() < 0.2 else None
            if how:
                cancelled.add(stream.request_id)
            if how == "now":
                stream.cancel()
            elif how == "soon":
                threading.Timer(rng.uniform(0, 0.2), stream.cancel).start()
            stop_at = {"first-token": 1, "decode": rng.randint(3, 6)}.get(how)  # drawn here: one seeded sequence
            t = threading.Thread(target=consume, args=(stream, stop_at))
            t.start()
            threads.append(t)
        for t in threads:
            t.join(120)
    wait_for(lambda: all(s.finished for s in done) and len(done) == 200, 60, "every stream to end")
    assert 30 <= len(cancelled) <= 50, len(cancelled)
    print("cancelled:", len(cancelled), "aborted:", sum(s.finish_reason == "abort" for s in done))
    for s in done:
        if s.request_id not in cancelled:
            assert s.finish_reason == "length" and s.error is None, (s.request_id, s.error)
            assert len(s.token_ids) == s.decision["max_tokens"]
        else:
            assert s.finish_reason in ("abort", "length"), (s.request_id, s.finish_reason, s.error)
    assert_idle(cluster)
    assert segments(cluster) == []
    assert cluster.health()["status"] == "ok"
    counters = cluster.snapshot()["splits"]["counters"]
    aborted = sum(s.finish_reason == "abort" for s in done)
    assert counters["failed"] == 0
    scraped = dict(line.rsplit(" ", 1) for line in ServingMetrics(cluster).render().decode().splitlines()
                   if line.startswith("minivllm_split_"))
    for phase in ("prefill", "transfer", "decode"):
        key = f'minivllm_split_requests_total{{outcome="cancelled_in_{phase}"}}'
        assert float(scraped[key]) == counters[f"cancelled_in_{phase}"]
    assert float(scraped["minivllm_split_kv_bytes_total"]) == counters["kv_bytes"] > 0
    assert sum(counters[f"cancelled_in_{p}"] for p in ("prefill", "transfer", "decode")) == aborted
    assert all(counters[f"cancelled_in_{p}"] > 0 for p in ("prefill", "transfer", "decode")), counters
    print("split counters:", counters)


def test_a_decode_worker_killed_during_the_import_fails_only_that_request(smollm2_path, tmp_path):
    with Cluster(str(smollm2_path), ["cpu:1", "cpu:1"], router="round-robin", max_model_len=256,
                 batch_invariant=True, rates_profile=profile_file(tmp_path), max_worker_restarts=0) as cluster:
        # B cannot reserve pages (A waits for them a second, decoding on, then writes a
        # segment) nor take the import: both wait in its pipe.
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        pid_b = cluster.workers[B].transport.pid
        os.kill(pid_b, signal.SIGSTOP)
        try:
            split = cluster.submit(PROMPT, params, placement=(A, B))
            other = cluster.submit("An unrelated question: why is the sky blue?", params, worker=A)
            wait_for(lambda: cluster.snapshot()["splits"]["live"].get(split.request_id) == "transfer", 60,
                     "the K/V to leave A")
            assert len(segments(cluster)) == 1  # written by A, not read yet
        finally:
            cluster.kill_worker(B)
            os.kill(pid_b, signal.SIGCONT)
        out = split.result(30)
        assert out.finish_reason == "error" and f"worker {B}" in out.error and "SIGKILL" in out.error, out.error
        assert split.token_ids  # A's tokens reached the client
        assert other.result(60).finish_reason == "length"
        assert segments(cluster) == []
        assert cluster.health()["status"] == "degraded"
        again = cluster.submit(PROMPT, params, worker=A).result(60)  # the server goes on
        assert again.finish_reason == "length" and len(again.token_ids) == 200
        counters = cluster.snapshot()["splits"]["counters"]
        assert counters["failed"] == 1 and counters["handed_off"] == 0


def test_both_workers_trace_the_handoff_through_a_segment(smollm2_path, tmp_path):
    # Reference: the trace files themselves (Chrome trace JSON, one per worker process), and
    # the whole request on A. Pools nobody else can map: the K/V cross in a segment.
    with Cluster(str(smollm2_path), ["cpu:1", "cpu:1"], router="round-robin", max_model_len=256,
                 calibrate=False, trace_directory=str(tmp_path), batch_invariant=True, kv_shareable=False) as cluster:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        whole = cluster.submit(PROMPT, params, worker=A).result(120)
        stream = cluster.submit(PROMPT, params, placement=(A, B))
        out = stream.result(120)
        assert out.finish_reason == "length" and out.token_ids == whole.token_ids
        split = stream.metrics["split"]
        assert split["transport"] == "segment" and split["landing"] is None and split["tokens_on_prefill_worker"] == 1
        assert segments(cluster) == []
        rid = stream.request_id
    events = {}
    for path in tmp_path.glob("minivllm-trace-*.json"):
        trace = json.loads(path.read_text())
        trace = trace["traceEvents"] if isinstance(trace, dict) else trace
        names = [e["args"]["name"] for e in trace if e.get("ph") == "M" and e.get("name") == "process_name"]
        worker = next(n.removeprefix("minivllm worker ") for n in names)
        events[worker] = [e for e in trace if e.get("cat") == "handoff"]
    assert set(events) == {A, B}
    assert [(e["name"], e["args"]["request"]) for e in events[A]] == [("handoff export", rid)]
    assert [(e["name"], e["args"]["request"]) for e in events[B]] == [("handoff import", rid)]
    assert all(e["dur"] > 0 for e in events[A] + events[B])


def _mapped_inodes(pid: int) -> set[int]:
    """Inodes of the files process `pid` has mapped (the 5th field of /proc/PID/maps)."""
    return {int(line.split()[4]) for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
            if len(line.split()) > 5}


def test_workers_map_each_others_pools_at_start_and_after_a_restart(smollm2_path, tmp_path):
    """Before any split request, each worker has mapped its peer's KV pool (seen in its own
    /proc/PID/maps by the pool's inode), so a first split does not wait for the mapping
    (nor, from a GPU worker, for the host registration of the whole pool); after B is
    replaced, A maps B's new pool."""
    with Cluster(str(smollm2_path), ["cpu:1", "cpu:1"], router="round-robin", max_model_len=256,
                 max_worker_restarts=0) as cluster:
        def maps_peer(name: str, peer: str) -> bool:
            inode = cluster.workers[peer].info["kv_landing"]["inode"]
            return inode in _mapped_inodes(cluster.workers[name].transport.pid)

        wait_for(lambda: maps_peer(A, B) and maps_peer(B, A), 10, "each worker mapping the other's pool")
        assert cluster.snapshot()["splits"]["counters"]["started"] == 0
        old = cluster.workers[B].info["kv_landing"]["inode"]
        cluster.restart_worker(B)
        assert cluster.workers[B].info["kv_landing"]["inode"] != old
        wait_for(lambda: maps_peer(A, B) and maps_peer(B, A), 10, "A mapping B's new pool, B mapping A's")
