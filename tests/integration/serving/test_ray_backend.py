"""The Ray backend on a real two-node Ray cluster: serving, routing and a node crash.

A head node and a second node (`ray start --address`) run on 127.0.0.1, one CPU each
(tests/ray_nodes.py); two one-thread SmolLM2-135M workers are pinned one per node and
served through the real HTTP API. References: transformers' own greedy decode of the
same GGUF for the streamed tokens, the router's recorded decision for the prefix-aware
choice, the wall clock for the kill drill (the dead node's streams end with an error
within 5 s, as the issue's target says), the survivor's own KV snapshot for leaked pages,
and Ray's node table for where the worker, restarted by itself, landed.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from conftest import transformers_greedy

from minivllm.serving import Cluster
from minivllm.serving.http_server import start_server_in_background

ray = pytest.importorskip("ray")

from ray_nodes import RayNodes  # noqa: E402

KEY = "ray-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
DEATH_NOTICE_S = 5.0


def profile_file(tmp_path):
    path = tmp_path / "rates.json"
    path.write_text(json.dumps({"workers": {n: {"prefill_tps": 100.0, "decode_tps": {"1": 15.0, "4": 40.0}}
                                            for n in ("cpu", "cpu#2")}}))
    return str(path)


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def nodes():
    cluster = RayNodes(cpus_per_node=1)
    try:
        cluster.start_head()
        cluster.add_node()
        yield cluster
    finally:
        cluster.stop()
        assert not cluster.tagged_processes(), "Ray processes of the test cluster are still running"


async def stream(client, url, body):
    """One streaming completion: (request id, token texts, finish reason or error text, end time)."""
    texts, ending, rid = [], None, None
    async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}, headers=AUTH) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                ending = "error: " + chunk["error"]["message"]
                continue
            rid = chunk["id"]
            choice = chunk["choices"][0]
            texts.append(choice["text"])
            ending = choice.get("finish_reason") or ending
    return rid, texts, ending, time.monotonic()


@pytest.fixture(scope="module")
def greedy_reference(smollm2_path):
    """(prompt, n, text): transformers' own greedy continuation of the same GGUF, cut
    before its first near-tie, so that any correct engine must produce exactly it."""
    from transformers import AutoModelForCausalLM

    from minivllm.gguf.tokenizer import Tokenizer

    ref = AutoModelForCausalLM.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name,
                                               torch_dtype="float32")
    tokenizer = Tokenizer.from_gguf(smollm2_path)
    prompt = "The three primary colours are"
    theirs, margins, _ = transformers_greedy(ref, tokenizer.encode(prompt), 10)
    clear = next((i for i, m in enumerate(margins) if m < 1e-3), len(margins))
    assert clear >= 5, f"the reference has a near-tie at token {clear}: pick another prompt"
    return prompt, clear, tokenizer.decode(theirs[:clear])


def test_messages_through_ray_when_the_direct_link_is_off(nodes, smollm2_path, greedy_reference, monkeypatch):
    """The fallback link (actor calls and long polls, for a controller the nodes cannot
    reach) streams the same tokens, and a killed actor still fails its stream within 5 s."""
    monkeypatch.setenv("MINIVLLM_RAY_DIRECT", "0")
    head_id, _ = nodes.node_ids
    prompt, clear, want = greedy_reference
    cluster = Cluster(str(smollm2_path), [f"node={head_id[:12]}:cpu:1"], backend="ray", ray_address=nodes.address,
                      max_model_len=256).start()
    try:
        assert cluster.snapshot()["workers"][0]["location"]["link"] == "ray"
        streamed = [e.text for e in cluster.submit(prompt, _params(clear))]
        assert "".join(streamed) == want, streamed

        request = cluster.submit("Once upon a time", _params(200))
        wait_for(lambda: any(f.output_tokens > 2 for f in cluster.workers["cpu"].in_flight.values()), 60,
                 "the stream to start")
        killed_at = time.monotonic()
        ray.kill(cluster.workers["cpu"].transport._actor, no_restart=True)
        request.result(timeout=30)
        assert time.monotonic() - killed_at <= DEATH_NOTICE_S
        assert request.finish_reason == "error" and "cpu" in request.error, (request.finish_reason, request.error)
        assert cluster.snapshot()["requests"]["open"] == 0
    finally:
        cluster.stop()


def test_two_nodes_stream_route_by_prefix_and_survive_a_node_crash(nodes, smollm2_path, greedy_reference, tmp_path):
    head_id, second_id = nodes.node_ids
    cluster = Cluster(str(smollm2_path), [f"node={head_id[:12]}:cpu:1", f"node={second_id[:12]}:cpu:1"],
                      backend="ray", ray_address=nodes.address, router="cost", max_model_len=512,
                      rates_profile=profile_file(tmp_path), max_queued_prompt_tokens=None).start()
    srv = start_server_in_background(cluster, api_key=KEY)
    try:
        placed = {w["name"]: w["location"].get("node_id") for w in cluster.snapshot()["workers"]}
        assert placed == {"cpu": head_id, "cpu#2": second_id}, placed

        links = {w["name"]: w["location"].get("link") for w in cluster.snapshot()["workers"]}
        assert links == {"cpu": "direct", "cpu#2": "direct"}, links

        # 1. Streaming from each node: the tokens are transformers' greedy tokens.
        prompt, clear, want = greedy_reference
        for name in ("cpu", "cpu#2"):
            async def one(name=name):
                async with httpx.AsyncClient(timeout=120) as client:
                    return await stream(client, srv.url, {"prompt": prompt, "max_tokens": clear, "temperature": 0,
                                                          "ignore_eos": True})
            cluster.set_router(f"forced:{name}")
            _, texts, ending, _ = asyncio.run(one())
            assert "".join(texts) == want and ending == "length", (name, texts, ending)
        cluster.set_router("cost")

        # 2. Prefix-aware routing across nodes: a prompt whose prefix only cpu#2 holds goes there.
        shared = "Here is a long shared system prompt about page tables. " * 8
        cluster.set_router("forced:cpu#2")
        cluster.submit(shared + "First question?", _params(4)).result()
        cluster.set_router("cost")
        routed = cluster.submit(shared + "Second question?", _params(4))
        routed.result()
        decision = routed.decision
        cached = {c["worker"]: c["cached_tokens"] for c in decision["candidates"]}
        assert routed.worker == "cpu#2" and cached["cpu#2"] >= 48 and cached["cpu"] == 0, decision

        # 3. A node crash mid-stream: its streams end with an error within 5 s, the
        # survivor's streams all finish, and the survivor holds no page afterwards.
        async def drill():
            async with httpx.AsyncClient(timeout=300) as client:
                body = {"max_tokens": 96, "temperature": 0, "ignore_eos": True}
                tasks = []
                for i, name in enumerate(["cpu", "cpu#2", "cpu", "cpu#2"]):
                    cluster.set_router(f"forced:{name}")
                    tasks.append(asyncio.create_task(stream(client, srv.url, {**body, "prompt": f"Story {i}: once"})))
                    await asyncio.sleep(0.05)
                cluster.set_router("cost")
                await asyncio.to_thread(wait_for, lambda: all(f.output_tokens > 2 for h in cluster.workers.values()
                                                              for f in h.in_flight.values())
                                        and sum(len(h.in_flight) for h in cluster.workers.values()) == 4,
                                        120, "every stream to produce tokens")
                killed_at = time.monotonic()
                assert nodes.kill_node(1) >= 1  # the worker died with its node, not seconds later
                return killed_at, await asyncio.gather(*tasks)

        killed_at, results = asyncio.run(drill())
        by_worker = {"cpu": results[0::2], "cpu#2": results[1::2]}
        for _, texts, ending, _ in by_worker["cpu"]:
            assert ending == "length" and len(texts) == 96, ending
        for _, _, ending, ended_at in by_worker["cpu#2"]:
            assert ending and ending.startswith("error") and "cpu#2" in ending, ending
            assert "restarting it automatically" in ending, ending
            print(f"kill drill: the dead node's stream ended {ended_at - killed_at:.2f} s after the kill")
            assert ended_at - killed_at <= DEATH_NOTICE_S, (
                f"the dead node's stream ended {ended_at - killed_at:.2f} s after the kill"
            )
        assert cluster.workers["cpu#2"].state != "ready"  # dead, or its replacement waits for a node
        snap = cluster.snapshot(fresh=True)
        survivor = next(w for w in snap["workers"] if w["name"] == "cpu")
        kv = survivor["snapshot"]["kv"]
        assert kv["available_pages"] + kv["reserved_pages"] == kv["total_pages"] and not survivor["in_flight"], kv
        ledger = snap["requests"]
        assert ledger["open"] == 0 and ledger["duplicate_terminals"] == 0, ledger

        # 4. The cluster restarts cpu#2 by itself (worker_recovery.py, through the same
        # transport interface as a local process) once a node has the resources: a new one.
        # add_node counts alive nodes before and after: wait for Ray to count the dead one out.
        wait_for(lambda: second_id not in nodes.alive(), 120, "Ray to mark the killed node dead")
        third_id = nodes.add_node()
        wait_for(lambda: cluster.health()["status"] == "ok", 300, "cpu#2 to restart by itself on the new node")
        assert cluster.health()["workers"][1]["restarts"]["automatic"] >= 1
        assert cluster.workers["cpu#2"].transport.location.get("node_id") == third_id or wait_location(
            cluster, third_id
        )
        cluster.set_router("forced:cpu#2")
        assert cluster.submit(prompt, _params(clear)).result().text == want
    finally:
        srv.stop()
        cluster.stop()


def wait_location(cluster, node_id) -> bool:
    wait_for(lambda: cluster.workers["cpu#2"].transport.location.get("node_id") == node_id, 10,
             "the restarted worker to report its node")
    return True


def _params(n):
    from minivllm.sampling.sampling_params import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
