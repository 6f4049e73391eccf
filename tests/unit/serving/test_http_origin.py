"""`http_origin`: which Host and Origin values a server without a key answers, on
hand-written ASGI scopes (the live server's checks are in test_server_lockouts.py).

The reference is the browser's behaviour the guard is built against (Fetch standard):
cross-site pages may send simple requests (GET, or POST with text/plain, form or
multipart bodies) without a preflight, always with an Origin header on a POST; a
DNS-rebinding page reaches the server under its own Host name.
"""

from __future__ import annotations

import pytest

from minivllm.cli.main import build_parser
from minivllm.serving.http_origin import LocalOnlyGuard, allowed_hosts_for, host_name, is_loopback


def scope(method: str, path: str, **headers: str) -> dict:
    return {"type": "http", "method": method, "path": path,
            "headers": [(k.replace("_", "-").lower().encode(), v.encode()) for k, v in headers.items()]}


@pytest.mark.parametrize("value, name", [
    ("127.0.0.1:8000", "127.0.0.1"), ("[::1]:8000", "::1"), ("[::1]", "::1"), ("LocalHost", "localhost"),
    ("example.com.", "example.com"), ("example.com:443", "example.com"), ("::1", "::1"),
])
def test_host_names(value, name):
    assert host_name(value) == name


@pytest.mark.parametrize("host, loopback", [
    ("localhost", True), ("api.localhost", True), ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True),
    ("0.0.0.0", False), ("10.0.0.1", False), ("localhost.evil.example", False), ("evil.example", False), ("", False),
])
def test_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_the_bind_address_is_allowed_unless_it_is_a_wildcard():
    assert allowed_hosts_for("10.1.2.3", ("Box.Lan",)) == ("box.lan", "10.1.2.3")
    assert allowed_hosts_for("0.0.0.0", ()) == () and allowed_hosts_for("::", ("a",)) == ("a",)


GUARD = LocalOnlyGuard(app=None, allowed_hosts=("served.example",))


@pytest.mark.parametrize("request_scope, status", [
    (scope("GET", "/v1/cluster/snapshot", host="127.0.0.1:8000"), None),
    (scope("GET", "/v1/cluster/snapshot", host="served.example:8000"), None),
    (scope("GET", "/v1/cluster/snapshot", host="rebound.example:8000"), 403),        # DNS rebinding
    (scope("POST", "/v1/completions", host="localhost", origin="http://localhost:3000",
           content_type="application/json"), None),
    (scope("POST", "/v1/completions", host="localhost", origin="https://evil.example",
           content_type="text/plain"), 403),                                        # cross-site simple POST
    (scope("POST", "/v1/completions", host="localhost", origin="null"), 403),        # sandboxed frame, file://
    (scope("POST", "/v1/cluster/workers/cpu/restart", host="localhost", content_type="text/plain"), 415),
    (scope("POST", "/v1/cluster/workers/cpu/restart", host="localhost",
           content_type="application/x-www-form-urlencoded"), 415),
    (scope("POST", "/v1/cluster/workers/cpu/restart", host="localhost"), 415),      # no type at all
    (scope("POST", "/v1/cluster/workers/cpu/restart", host="localhost",
           content_type="application/json; charset=utf-8"), None),
    (scope("POST", "/v1/cluster/workers/cpu/restart", host="localhost", x_requested_with="curl"), None),
    (scope("POST", "/v1/cluster/workers/cpu/restart", host="localhost", origin="http://evil.example",
           content_type="application/json"), 403),
])
def test_refusals(request_scope, status):
    refused = GUARD.refusal(request_scope)
    assert (refused[0] if refused else None) == status, refused


def test_the_flag_is_repeatable_and_empty_by_default():
    assert build_parser().parse_args(["serve"]).allowed_host == []
    assert build_parser().parse_args(["serve", "--allowed-host", "a.lan", "--allowed-host", "b"]).allowed_host == [
        "a.lan",
        "b",
    ]
