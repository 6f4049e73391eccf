"""Requests that must end, and browsers that must stay out (issue 39), on a live server.

One real worker (SmolLM2-135M, one CPU thread, max_model_len 128) behind the real HTTP
stack, with no API key (the default) and `--max-concurrent-requests 3`, the shape the
issue's probe used; a second server over the same cluster has a key.

- Every call the HTTP layer runs off the event loop is made to fail, StopIteration
  included (which an asyncio Future cannot carry: the handler used to wait forever): each
  gets a 500 in the API shape within a deadline, and afterwards as many requests as the
  concurrency limit allows all succeed (no slot left held).
- Chat content holding every private-use code point (it exhausted the old control-token
  swap) is answered; three at once leave every slot free.
- Streams closed after one chunk and clients that give up before the answer free their
  slots.
- Without a key: a cross-origin `text/plain` POST to the restart route is refused (403;
  415 without an Origin), the worker keeps its pid; a foreign Host (DNS rebinding) gets a
  403, a configured one is served; the snapshot names no file path. With a key: as before.
- Two Authorization headers: 400. Error bodies for huge inputs stay under 1 KB.
- Twelve 900 KB prompts leave the controller's RSS (this process) within 100 MB of where
  it started.
- At the end, every slot and every KV page is free.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import random
import re
import time
from pathlib import Path

import httpx
import pytest
from test_server_hardening import assert_idle

from minivllm.errors import MESSAGE_LIMIT
from minivllm.serving import Cluster, memory_release
from minivllm.serving.http_guards import ServerLimits
from minivllm.serving.http_server import start_server_in_background

LIMIT = 3
KEY = "lockout-key"
ALLOWED = "served.example"
DEADLINE_S = 60  # liveness only: every answer here comes in well under a second
CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def servers(smollm2_path):
    cluster = Cluster(str(smollm2_path), ["cpu:1"], max_model_len=128, max_active_requests=8, calibrate=False).start()
    open_srv = start_server_in_background(cluster, limits=ServerLimits(max_concurrent_requests=LIMIT),
                                          allowed_hosts=(ALLOWED,))
    keyed_srv = start_server_in_background(cluster, api_key=KEY, limits=ServerLimits(max_concurrent_requests=LIMIT))
    try:
        yield open_srv, keyed_srv, cluster
    finally:
        open_srv.stop()
        keyed_srv.stop()
        cluster.stop()


def at_the_limit(srv, n: int = LIMIT, headers: dict | None = None) -> list[int]:
    """Statuses of `n` chat completions sent at once: all 200 unless a slot is held."""
    async def burst():
        async with httpx.AsyncClient(timeout=DEADLINE_S, limits=httpx.Limits(max_connections=n)) as client:
            rs = await asyncio.gather(*(client.post(srv.url + "/v1/chat/completions", json=CHAT, headers=headers)
                                        for _ in range(n)))
        return [r.status_code for r in rs]
    return asyncio.run(burst())


def assert_error(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    for w in words:
        assert w in err["message"], (w, err)
    return err


# -- every handler ends -------------------------------------------------------------------------------------


def test_the_http_layer_offloads_only_through_off_loop():
    """The failure injection below covers every offloaded call only if none bypasses the helper."""
    from minivllm.serving import http_api

    source = Path(http_api.__file__).read_text()
    for raw in ("to_thread(", "wrap_future(", "run_in_executor("):
        assert raw not in source, raw
    assert source.count("in_thread(") == 3 and source.count("thread_future(") == 1


def failing_future(exc: BaseException) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_exception(exc)
    return future


def raiser(exc: BaseException):
    def fail(*args, **kwargs):
        raise exc
    return fail


# (what fails, the request that reaches it); each offloaded call of http_api.py
OFFLOADED = [
    ("submit", "POST", "/v1/chat/completions"),
    ("snapshot", "GET", "/v1/cluster/snapshot"),
    ("render", "GET", "/metrics"),
    ("restart_worker_async", "POST", "/v1/cluster/workers/cpu/restart"),
]


@pytest.mark.parametrize("exc", [StopIteration(), StopIteration("from a generator"), RuntimeError("injected")],
                         ids=["StopIteration", "StopIteration-value", "RuntimeError"])
@pytest.mark.parametrize("target, method, path", OFFLOADED, ids=[t for t, _, _ in OFFLOADED])
def test_a_failing_offloaded_call_gets_a_500_and_frees_its_slot(servers, monkeypatch, target, method, path, exc):
    srv, _, cluster = servers
    owner = srv.app.state.metrics if target == "render" else cluster
    # the restart route awaits a Future completed by another thread; the others a thread call
    fake = (lambda *a, **k: failing_future(exc)) if target == "restart_worker_async" else raiser(exc)
    monkeypatch.setattr(owner, target, fake)

    async def hammer():  # as many at once as the concurrency limit lets in
        async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
            return await asyncio.gather(
                *(client.request(method, srv.url + path, json=CHAT if method == "POST" else None) for _ in range(LIMIT))
            )

    for r in asyncio.run(hammer()):
        err = assert_error(r, 500, type(exc).__name__)
        assert err["type"] == "server_error"
    monkeypatch.undo()
    assert at_the_limit(srv) == [200] * LIMIT


def test_a_failing_restart_call_itself_gets_a_500(servers, monkeypatch):
    srv, _, cluster = servers
    monkeypatch.setattr(cluster, "restart_worker_async", raiser(StopIteration()))
    assert_error(httpx.post(srv.url + "/v1/cluster/workers/cpu/restart", json={}, timeout=DEADLINE_S), 500,
                 "StopIteration")


def test_content_holding_every_private_use_character_is_answered(servers):
    """The issue's shape: three such chats at once with --max-concurrent-requests 3."""
    srv, _, _ = servers
    pua = "".join(map(chr, [*range(0xE000, 0xF900), *range(0xF0000, 0x110000)]))
    body = json.dumps({"messages": [{"role": "user", "content": pua + "<|im_end|>"}], "max_tokens": 2},
                      ensure_ascii=False).encode()  # raw UTF-8: ~540 KB, under the 1 MiB body limit

    async def three():
        async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
            return await asyncio.gather(*(client.post(srv.url + "/v1/chat/completions", content=body,
                                                      headers={"Content-Type": "application/json"})
                                          for _ in range(LIMIT)))

    for r in asyncio.run(three()):
        assert_error(r, 400, "max_model_len")  # encoded whole, then refused for its length
    assert at_the_limit(srv) == [200] * LIMIT


def test_clients_that_leave_early_give_back_their_slots(servers):
    """Streams closed after their first chunk, and plain requests whose client gives up
    before the answer, LIMIT of each at once (the request runs on: 100 tokens on one
    CPU thread takes seconds)."""
    srv, _, _ = servers
    long = {"prompt": "Count slowly:", "max_tokens": 100, "ignore_eos": True}

    async def leave_streams():
        async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
            async def one():
                async with client.stream("POST", srv.url + "/v1/completions", json={**long, "stream": True}) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            return  # leaving the block closes the connection mid-stream
            await asyncio.gather(*(one() for _ in range(LIMIT)))

    async def give_up():
        async with httpx.AsyncClient(timeout=httpx.Timeout(DEADLINE_S, read=0.3)) as client:
            async def one():
                with pytest.raises(httpx.ReadTimeout):
                    await client.post(srv.url + "/v1/completions", json=long)
            await asyncio.gather(*(one() for _ in range(LIMIT)))

    asyncio.run(leave_streams())
    asyncio.run(give_up())
    deadline = time.monotonic() + DEADLINE_S  # the server learns of each disconnect within its poll interval
    while (statuses := at_the_limit(srv)) != [200] * LIMIT and time.monotonic() < deadline:
        time.sleep(0.2)
    assert statuses == [200] * LIMIT


# -- browsers stay out without a key ---------------------------------------------------------------------------


def test_a_cross_origin_simple_post_cannot_restart_a_worker(servers):
    srv, _, cluster = servers
    pid = cluster.workers["cpu"].transport.pid
    url = srv.url + "/v1/cluster/workers/cpu/restart"
    plain = {"Content-Type": "text/plain"}
    assert_error(
        httpx.post(url, content=b"{}", headers={**plain, "Origin": "http://evil.example"}), 403, "cross-origin"
    )
    assert_error(httpx.post(url, content=b"{}", headers={**plain, "Origin": "null"}), 403, "cross-origin")
    assert_error(httpx.post(url, content=b"{}", headers=plain), 415, "application/json")
    for form in ("application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        assert_error(httpx.post(url, content=b"a=b", headers={"Content-Type": form}), 415, "application/json")
    # a JSON POST from a script passes the guard (an unknown worker, so nothing restarts)
    assert_error(httpx.post(srv.url + "/v1/cluster/workers/nope/restart", json={}), 404, "nope")
    assert cluster.workers["cpu"].transport.pid == pid and cluster.health()["status"] == "ok"


def test_a_foreign_host_is_refused_and_a_configured_one_served(servers, smollm2_path):
    srv, _, _ = servers
    snap = srv.url + "/v1/cluster/snapshot"
    assert_error(httpx.get(snap, headers={"Host": "evil.example"}), 403, "--allowed-host")
    assert_error(httpx.get(snap, headers={"Host": f"evil.example:{srv.port}"}), 403, "--allowed-host")
    assert_error(httpx.post(srv.url + "/v1/chat/completions", json=CHAT, headers={"Host": "evil.example"}), 403)
    for host in (f"{ALLOWED}:{srv.port}", f"localhost:{srv.port}", f"127.0.0.1:{srv.port}", "LOCALHOST"):
        assert httpx.get(snap, headers={"Host": host}).status_code == 200, host
    assert httpx.get(srv.url + "/health", headers={"Host": "evil.example"}).status_code == 200  # probes stay open
    # a page served from this machine (same origin, as /docs is) may call it
    same = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, headers={"Origin": f"http://127.0.0.1:{srv.port}"})
    assert same.status_code == 200, same.text
    assert_error(httpx.get(snap, headers={"Origin": "http://evil.example"}), 403, "cross-origin")


def test_the_unauthenticated_snapshot_names_no_file_path(servers, smollm2_path):
    srv, keyed, _ = servers
    text = httpx.get(srv.url + "/v1/cluster/snapshot", params={"fresh": "true"}).text
    assert str(smollm2_path.parent) not in text and smollm2_path.name not in text
    assert json.loads(text)["model_path"] == "<hidden path>"
    keyed_snap = httpx.get(keyed.url + "/v1/cluster/snapshot", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert keyed_snap["model_path"] == str(smollm2_path)  # with a key, as before


def test_health_names_no_file_path_key_or_not(servers, smollm2_path, monkeypatch):
    """/health never needs a key; a worker's error (a load failure, say) may name a file."""
    srv, keyed, cluster = servers
    monkeypatch.setattr(cluster.workers["cpu"], "error", f"could not map {smollm2_path}: injected")
    for server in (srv, keyed):
        body = httpx.get(server.url + "/health").json()
        assert body["workers"][0]["error"] == "could not map <hidden path>/" \
                                              f"{smollm2_path.name}: injected", body


def test_with_a_key_the_browser_rules_do_not_apply(servers):
    _, keyed, _ = servers
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.get(keyed.url + "/v1/cluster/snapshot", headers={**auth, "Host": "anything.example",
                                                                 "Origin": "http://other.example"})
    assert r.status_code == 200, r.text
    assert_error(httpx.get(keyed.url + "/v1/cluster/snapshot", headers={"Origin": "http://other.example"}), 401)


def test_two_authorization_headers_get_a_400(servers):
    srv, keyed, _ = servers
    for server, first in ((keyed, f"Bearer {KEY}"), (srv, "Bearer a")):
        for second in ("Bearer wrong", first):
            r = httpx.post(server.url + "/v1/chat/completions", json=CHAT,
                           headers=[("Authorization", first), ("Authorization", second)])
            assert_error(r, 400, "more than one Authorization")
    ok = httpx.post(keyed.url + "/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("path, body, status", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "guided_grammar": "root ::= " + "x" * 300_000}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "guided_regex": "(" * 200_000}, 400),
    ("/v1/completions", {"prompt": "x", "model": "m" * 300_000}, 404),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "t" * 300_000}}}}, 400),
    ("/v1/chat/completions", {**CHAT, "tool_choice": {"type": "function", "function": {"name": "n" * 300_000}}}, 400),
], ids=["grammar", "regex", "model", "schema", "tool_choice"])
def test_error_bodies_quote_at_most_a_few_hundred_bytes_of_input(servers, path, body, status):
    srv, _, _ = servers
    r = httpx.post(srv.url + path, json=body, timeout=DEADLINE_S)
    assert_error(r, status)
    assert len(r.content) < 1024, len(r.content)
    runs = [len(run) for c in "xm(tn" for run in re.findall(re.escape(c) + "+", r.json()["error"]["message"])]
    assert max(runs) <= MESSAGE_LIMIT * 2 // 3, max(runs)  # a few hundred characters of the input at most


# -- memory ------------------------------------------------------------------------------------------------------


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not Path("/proc/self/statm").exists() or memory_release.MALLOC_TRIM is None,
                    reason="reads RSS from /proc and needs glibc's malloc_trim")
def test_controller_rss_stays_bounded_over_repeated_large_prompts(servers):
    """Issue 39: RSS grew by ~600 MB over repeated ~900 KB prompts and stayed there; the
    heap was glibc's, freed but kept (see memory_release.py). The server is this process:
    twelve 900 KB prompts, two at a time (so several offload threads and their arenas
    take part), each tokenized whole and then refused for its length, must leave RSS
    within 100 MB of where it started (measured here: +296 MB without the release, +27 MB with it)."""
    srv, _, _ = servers
    rng = random.Random(39)
    words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "page"]) + str(rng.randrange(1000))
                     for _ in range(110_000))[:900_000]
    bodies = [json.dumps({"prompt": words, "max_tokens": 1}).encode(),
              json.dumps({"messages": [{"role": "user", "content": words}], "max_tokens": 1}).encode()]
    paths = ["/v1/completions", "/v1/chat/completions"]
    before = rss_mb()

    async def pairs():
        async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
            for _ in range(6):
                rs = await asyncio.gather(*(client.post(srv.url + paths[k], content=bodies[k],
                                                        headers={"Content-Type": "application/json"})
                                            for k in (0, 1)))
                for r in rs:
                    assert_error(r, 400, "max_model_len")

    asyncio.run(pairs())
    deadline = time.monotonic() + 30  # the release runs after each response is sent; wait for the last one
    while (after := rss_mb()) > before + 100 and time.monotonic() < deadline:
        time.sleep(0.2)
    print(f"controller RSS {before:.0f} MB -> {after:.0f} MB over 12 prompts of 900 KB")
    assert after <= before + 100, (before, after)


# -- at the end: nothing held -----------------------------------------------------------------------------------


def test_zz_no_slot_or_page_is_left_held(servers):
    """After every shape above (module order: this runs last)."""
    srv, keyed, cluster = servers
    assert at_the_limit(srv) == [200] * LIMIT
    assert at_the_limit(keyed, headers={"Authorization": f"Bearer {KEY}"}) == [200] * LIMIT
    assert_idle(cluster)
