"""Hostile and broken input against a live server, which must keep serving.

One real worker (SmolLM2-135M, one CPU thread, max_model_len 128) behind the HTTP API
with an API key, a 64 KiB body limit and a concurrency limit of 6. Every bad request must
get a 4xx in the OpenAI error shape naming what was wrong; none may get a 5xx, crash the
worker (its pid stays the same) or leave a request open or a page held. The fuzzing
cases come from the server's own OpenAPI schema through schemathesis, positive and
negative, at least 300 of them.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from minivllm.cli.main import build_parser
from minivllm.serving import Cluster
from minivllm.serving.http_guards import ServerLimits
from minivllm.serving.http_server import DEFAULT_HOST, start_server_in_background

KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMITS = ServerLimits(max_request_bytes=64 * 1024, max_concurrent_requests=6)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def server(smollm2_path):
    cluster = Cluster(str(smollm2_path), ["cpu:1"], max_model_len=128, max_active_requests=8).start()
    srv = start_server_in_background(cluster, api_key=KEY, limits=LIMITS)
    pid = cluster.workers["cpu"].transport.pid
    yield srv, cluster
    try:
        # Whatever the tests threw at it, the same worker process is still serving,
        # nothing is left open and every page is back.
        assert cluster.workers["cpu"].transport.pid == pid and cluster.health()["status"] == "ok"
        ok = httpx.post(
            srv.url + "/v1/completions", headers=AUTH, timeout=60, json={"prompt": "Hello", "max_tokens": 2}
        )
        assert ok.status_code == 200, ok.text
        assert_idle(cluster)
    finally:
        srv.stop()
        cluster.stop()


def assert_idle(cluster, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        snap = cluster.snapshot(fresh=True)
        worker = snap["workers"][0]
        kv, q = worker["snapshot"]["kv"], worker["snapshot"]["queues"]
        if (snap["requests"]["open"] == 0 and not worker["in_flight"] and not (q["running"] or q["waiting"])
                and kv["available_pages"] == kv["total_pages"]):
            assert snap["requests"]["duplicate_terminals"] == 0, snap["requests"]
            return
        assert time.monotonic() < deadline, (snap["requests"], kv, q)
        time.sleep(0.1)


def post(srv, path: str, body, **kw) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, headers=AUTH, timeout=60, **kw)


def assert_error(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    for w in words:
        assert w in err["message"] or w == err["param"], (w, err)
    return err


# -- defaults that keep people out -----------------------------------------------------------------


def test_loopback_is_the_default_bind():
    args = build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1" == DEFAULT_HOST
    assert args.api_key is None and args.max_request_bytes == 1 << 20 and args.max_concurrent_requests == 256
    assert args.header_timeout == 10.0 and args.max_connections == 512 and args.max_queued_prompt_tokens == 32768
    assert args.prompt_special_tokens == "parse"


@pytest.mark.parametrize("method, path", [
    ("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
    ("GET", "/v1/cluster/snapshot"), ("POST", "/v1/cluster/workers/cpu/restart"), ("GET", "/metrics"),
    ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/no/such/route"),
])
def test_every_route_but_health_needs_the_key(server, method, path):
    srv, _ = server
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.request(method, srv.url + path, headers=headers, json={"prompt": "x"} if method == "POST" else None)
        assert_error(r, 401, "API key")
    assert httpx.get(srv.url + "/health").status_code == 200


# -- values ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("raw, param", [
    ('{"prompt": "x", "temperature": NaN}', "temperature"),
    ('{"prompt": "x", "temperature": Infinity}', "temperature"),
    ('{"prompt": "x", "top_p": NaN}', "top_p"),
    ('{"prompt": "x", "top_p": 1e999}', "top_p"),
    ('{"prompt": "x", "min_p": -Infinity}', "min_p"),
    ('{"prompt": "x", "repetition_penalty": Infinity}', "repetition_penalty"),
    ('{"prompt": "x", "presence_penalty": NaN}', "presence_penalty"),
    ('{"prompt": "x", "frequency_penalty": 2.5}', "frequency_penalty"),
    ('{"prompt": "x", "top_k": -7}', "top_k"),
    ('{"prompt": "x", "seed": -1}', "seed"),
    ('{"prompt": "x", "seed": 1180591620717411303424}', "seed"),
    ('{"prompt": "x", "max_tokens": 0}', "max_tokens"),
    ('{"prompt": "x", "max_tokens": -5}', "max_tokens"),
    ('{"prompt": "x", "max_tokens": 100000000000000000000000000000}', "max_tokens"),
    ('{"prompt": "x", "stop_token_ids": [-3]}', "stop_token_ids"),
    ('{"prompt": "x", "stop": ["a","b","c","d","e","f","g","h","i","j","k","l","m","n","o","p","q"]}', "stop"),
    ('{"prompt": "x", "stop": [""]}', "stop"),
    ('{"prompt": "ab\\ud800cd"}', "prompt"),
    ('{"prompt": "x", "stop": "\\udfff"}', "stop[0]"),
    ('{"prompt": [1, 2, -4]}', "prompt_token_ids"),
    ('{"prompt": "' + "word " * 200 + '"}', "prompt"),
    ('{"prompt": "x", "max_tokens": 128}', "max_tokens"),
    # JSON types are not coerced (issue 26)
    ('{"prompt": "x", "max_tokens": "5"}', "max_tokens"),
    ('{"prompt": "x", "temperature": "0.5"}', "temperature"),
    ('{"prompt": "x", "ignore_eos": 1}', "ignore_eos"),
    ('{"prompt": "x", "stream": "yes"}', "stream"),
    # stop_token_ids are checked against the vocabulary (SmolLM2: 49152 tokens)
    ('{"prompt": "x", "stop_token_ids": [1180591620717411303424]}', "stop_token_ids"),
    ('{"prompt": "x", "stop_token_ids": [2, 49152]}', "stop_token_ids"),
])
def test_out_of_range_values_get_a_400_naming_the_field(server, raw, param):
    srv, _ = server
    r = httpx.post(srv.url + "/v1/completions", content=raw.encode(), timeout=60,
                   headers={**AUTH, "Content-Type": "application/json"})
    err = assert_error(r, 400, param)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("messages, param", [
    ([], "messages"),
    ([{"role": "user", "content": ""}, {"role": "system", "content": None}], "messages"),
    ([{"role": "root", "content": "hi"}], "messages[0].role"),
    ([{"role": "__class__", "content": "hi"}], "messages[0].role"),
    ([{"content": "hi"}], "messages.0.role"),
    ([{"role": "user", "content": "hi \udc80 there"}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content"),
    ("hello", "messages"),
    ([{"role": "user", "content": 5}], "messages.0.content"),
])
def test_bad_chat_messages_get_a_400(server, messages, param):
    srv, _ = server
    raw = json.dumps({"messages": messages, "max_tokens": 4})  # json.dumps escapes the lone surrogate
    r = httpx.post(srv.url + "/v1/chat/completions", content=raw.encode(), timeout=60,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert_error(r, 400, param)


@pytest.mark.parametrize("body, words", [
    (b'{"prompt": "caf\xc3\xa9 \xff\xfe"}', ["UTF-8"]),          # invalid UTF-8 bytes
    (b'{"prompt": "unterminated', ["JSON"]),
    (b'["prompt", "x"]', ["body"]),                                 # JSON, but not an object
    (b'', ["body"]),
    (b'\x00\x01\x02', ["JSON"]),
])
def test_bodies_that_are_not_json_objects_get_a_400(server, body, words):
    srv, _ = server
    r = httpx.post(
        srv.url + "/v1/completions", content=body, timeout=30, headers={**AUTH, "Content-Type": "application/json"}
    )
    assert_error(r, 400, *words)


def test_invalid_json_names_no_field(server):
    """The parser's error position is a character offset, not a parameter (issue 26)."""
    srv, _ = server
    r = httpx.post(srv.url + "/v1/completions", content=b'{"prompt": "x", "max_tokens": 3,,}', timeout=30,
                   headers={**AUTH, "Content-Type": "application/json"})
    err = assert_error(r, 400, "not valid JSON", "at character")
    assert err["param"] is None


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"top_logprobs": 10**6}, "top_logprobs"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 5}, "top_logprobs"),
        ({"logprobs": True}, "logprobs"),
    ],
)
def test_chat_logprob_fields_are_refused_not_ignored(server, extra, param):
    srv, _ = server
    r = post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra})
    assert_error(r, 400, param)
    ok = post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                             "top_logprobs": 0, "logprobs": False})
    assert ok.status_code == 200, ok.text


def test_models_route_does_not_reveal_the_file_path(server, smollm2_path):
    srv, cluster = server
    body = httpx.get(srv.url + "/v1/models", headers=AUTH).text
    assert str(smollm2_path) not in body and str(smollm2_path.parent) not in body
    (model,) = json.loads(body)["data"]
    assert model["id"] == model["root"] == cluster.model_name


def test_oversized_bodies_get_a_413_declared_or_chunked(server):
    srv, _ = server
    big = json.dumps({"prompt": "x" * (LIMITS.max_request_bytes + 10)}).encode()
    assert_error(
        httpx.post(srv.url + "/v1/completions", content=big, headers={**AUTH, "Content-Type": "application/json"}),
        413,
        "--max-request-bytes",
        str(LIMITS.max_request_bytes),
    )

    def chunks():  # no Content-Length: the limit must count what arrives
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]
    r = httpx.post(srv.url + "/v1/completions", content=chunks(), headers={**AUTH, "Content-Type": "application/json"})
    assert "content-length" not in r.request.headers
    assert_error(r, 413, "--max-request-bytes")
    # just under the limit is parsed (and refused for its length in tokens, not its size)
    near = json.dumps({"prompt": "hi " * 10000, "max_tokens": 2}).encode()
    assert len(near) < LIMITS.max_request_bytes
    assert_error(httpx.post(srv.url + "/v1/completions", content=near, timeout=60,
                            headers={**AUTH, "Content-Type": "application/json"}), 400, "max_model_len")


def test_unknown_routes_and_methods_get_errors_in_the_api_shape(server):
    srv, _ = server
    assert_error(httpx.get(srv.url + "/v1/nothing", headers=AUTH), 404)
    assert_error(httpx.get(srv.url + "/v1/completions", headers=AUTH), 405)


# -- load ----------------------------------------------------------------------------------------------------


def test_many_concurrent_streams_over_the_limit_get_429_and_the_rest_finish(server):
    srv, cluster = server
    n = 3 * LIMITS.max_concurrent_requests

    async def one(client, i):
        body = {"prompt": f"Tell me about the number {i}.", "max_tokens": 24, "ignore_eos": True, "stream": True,
                "temperature": 0.8, "seed": i}
        async with client.stream("POST", srv.url + "/v1/completions", json=body, headers=AUTH) as r:
            if r.status_code != 200:
                return r.status_code, json.loads(await r.aread()), r.headers.get("retry-after")
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            return 200, lines, None

    async def burst():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=n)) as client:
            return await asyncio.gather(*(one(client, i) for i in range(n)))

    results = asyncio.run(burst())
    statuses = [s for s, _, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) >= LIMITS.max_concurrent_requests and statuses.count(429) >= 1, statuses
    for status, payload, retry in results:
        if status == 200:
            assert payload[-1] == "data: [DONE]"
            finish = json.loads(payload[-2][len("data: "):])["choices"][0]["finish_reason"]
            assert finish == "length"
        else:
            assert retry == "1" and "--max-concurrent-requests" in payload["error"]["message"]
    assert_idle(cluster)
    metrics = httpx.get(srv.url + "/metrics", headers=AUTH).text
    assert f'minivllm_rejected_requests_total{{reason="concurrency"}} {float(statuses.count(429))}' in metrics


# -- fuzzing from the OpenAPI schema ---------------------------------------------------------------------------


def test_schema_fuzzing_never_gets_a_5xx(server):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from schemathesis.generation import GenerationMode

    srv, cluster = server
    schema = schemathesis.openapi.from_url(srv.url + "/openapi.json", headers=AUTH)
    seen: list[tuple[str, int]] = []
    # Generating requests is cheap and the worker is one thread: most budget goes to the
    # two generation routes, in both modes (schema-valid and schema-violating bodies).
    plan = [
        ("/v1/completions", "POST", GenerationMode.POSITIVE, 110),
        ("/v1/completions", "POST", GenerationMode.NEGATIVE, 70),
        ("/v1/chat/completions", "POST", GenerationMode.POSITIVE, 70),
        ("/v1/chat/completions", "POST", GenerationMode.NEGATIVE, 50),
        ("/v1/cluster/snapshot", "GET", GenerationMode.NEGATIVE, 10),
        ("/v1/models", "GET", GenerationMode.POSITIVE, 5),
    ]

    def fuzz_operation(path: str, method: str, mode: GenerationMode, examples: int) -> None:
        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=schema[path][method].as_strategy(mode))
        def fuzz(case):
            response = case.call(headers=AUTH, timeout=120)
            seen.append((f"{method} {path} {mode.value}", response.status_code))
            assert response.status_code < 500, (case.body, case.query, response.status_code, response.text[:500])
            if response.status_code >= 400:
                assert "error" in response.json(), response.text[:300]

        fuzz()

    for path, method, mode, examples in plan:
        fuzz_operation(path, method, mode, examples)
    by_status: dict[int, int] = {}
    for _, status in seen:
        by_status[status] = by_status.get(status, 0) + 1
    print(f"schemathesis: {len(seen)} cases, statuses {sorted(by_status.items())}")
    assert len(seen) >= 300, len(seen)
    assert by_status.get(200, 0) >= 10 and by_status.get(400, 0) >= 100, by_status  # both outcomes were reached
    assert cluster.health()["status"] == "ok"
