"""What stands between the network and the API: the key, the body size and the number
of generation requests at once.

These are pure ASGI middlewares, not Starlette's `BaseHTTPMiddleware`: that one replaces
`receive`, and a handler behind it never sees its client disconnect, so a cancelled
stream would keep its KV pages. Here `receive` is passed through (or replayed from the
buffered body and then passed through), so disconnects still reach the handlers.

Each refusal is a JSON error in the OpenAI shape that says what the limit is and how to
change it; none of them reaches a worker.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from dataclasses import dataclass

from minivllm.errors import bounded_message
from minivllm.serving.memory_release import release_freed_memory, worth_releasing
from minivllm.serving.off_loop import in_thread

# Connection guards (enforced in http_connections.py, which needs uvicorn; the defaults live
# here so that the CLI can show them without the [serve] extra installed).
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 512
DEFAULT_MAX_REQUEST_BYTES = 1 << 20  # 1 MiB: a 128k-token prompt is ~0.5 MB of text
DEFAULT_MAX_CONCURRENT_REQUESTS = 256
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
OPEN_PATHS = ("/health",)


@dataclass(frozen=True)
class ServerLimits:
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS
    # connection guards (http_connections.py): request headers must be complete this many
    # seconds after a connection starts waiting for a request, and then the body this many
    # seconds after the headers (BodySizeLimit); connections open at once
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS

    def __post_init__(self):
        from minivllm.errors import ConfigError

        if not isinstance(self.max_request_bytes, int) or self.max_request_bytes < 1024:
            raise ConfigError("max_request_bytes", self.max_request_bytes, "must be an integer >= 1024")
        if not isinstance(self.max_concurrent_requests, int) or self.max_concurrent_requests < 1:
            raise ConfigError("max_concurrent_requests", self.max_concurrent_requests, "must be an integer >= 1")
        if (not isinstance(self.header_timeout_s, (int, float)) or isinstance(self.header_timeout_s, bool)
                or not 0 < self.header_timeout_s <= 3600):
            raise ConfigError("header_timeout_s", self.header_timeout_s, "must be a number of seconds in (0, 3600]")
        if not isinstance(self.max_connections, int) or self.max_connections < 1:
            raise ConfigError("max_connections", self.max_connections, "must be an integer >= 1")


def error_body(message: str, kind: str, param: str | None = None) -> bytes:
    """An error in OpenAI's shape. Every HTTP error body is made here, so none quotes
    more than `bounded_message` lets through of a client's input; ASCII-escaped JSON, so
    a lone surrogate quoted from bad input cannot fail its encoding."""
    return json.dumps({"error": {"message": bounded_message(message), "type": kind, "param": param,
                                 "code": None}}).encode()


async def send_error(send, status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> None:
    body = error_body(message, kind)
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


class ApiKeyGuard:
    """Every HTTP route but /health needs `Authorization: Bearer <key>`, the OpenAPI
    schema and the docs included (they are routes too); a request with two Authorization
    headers is refused on every route, key or not."""

    def __init__(self, app, api_key: str | None, open_paths: tuple[str, ...] = OPEN_PATHS, on_reject=None):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key is not None else None
        self.open_paths = open_paths
        self.on_reject = on_reject

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and sum(name == b"authorization" for name, _ in scope.get("headers") or []) > 1:
            # Proxies and servers disagree on which of two wins; answering either would let
            # one of them see a request the other checked under another identity.
            if self.on_reject:
                self.on_reject("auth")
            await send_error(send, 400, "the request has more than one Authorization header; send one",
                             "invalid_request_error")
            return
        if scope["type"] == "http" and self.expected is not None and scope["path"] not in self.open_paths:
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                if self.on_reject:
                    self.on_reject("auth")
                await send_error(send, 401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                 "authentication_error")
                return
        await self.app(scope, receive, send)


class BodySizeLimit:
    """Reads a request body up to `max_bytes` before the app sees it; a larger body
    (declared or actually sent, chunked or not) gets a 413 without being parsed. A body
    that has not all arrived `timeout_s` after its headers gets a 408 and the connection
    is closed (the header-read timeout's counterpart for clients that dribble a body).
    Once a large request has ended, the heap it freed goes back to the OS
    (`memory_release.py`)."""

    def __init__(self, app, max_bytes: int, on_reject=None, timeout_s: float | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.on_reject = on_reject
        self.timeout_s = timeout_s

    def _too_large(self, send, size: str):
        if self.on_reject:
            self.on_reject("too_large")
        return send_error(send, 413, f"request body is {size}, over this server's limit of {self.max_bytes} bytes; "
                                     "send a shorter prompt or start the server with a larger --max-request-bytes",
                          "invalid_request_error")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(send, f"{int(declared)} bytes")
            return
        chunks, size = [], 0
        deadline = None if self.timeout_s is None else asyncio.get_running_loop().time() + self.timeout_s
        while True:
            try:
                message = await (receive() if deadline is None else
                                 asyncio.wait_for(receive(), max(0.0, deadline - asyncio.get_running_loop().time())))
            except asyncio.TimeoutError:
                if self.on_reject:
                    self.on_reject("body_timeout")
                await send_error(send, 408, f"the request body did not arrive within {self.timeout_s:g} s of its "
                                            "headers (the server's --header-timeout); send the whole request at once",
                                 "invalid_request_error", {"connection": "close"})
                return
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nothing to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(send, f"more than {self.max_bytes} bytes")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        chunks.clear()
        replayed = False

        async def replay():
            nonlocal replayed, body
            if not replayed:
                replayed = True
                message, body = {"type": "http.request", "body": body, "more_body": False}, b""
                return message
            return await receive()  # from here on: disconnect notices, passed through

        await self.app(scope, replay, send)
        if worth_releasing(size):  # the request's memory is free now, but glibc would keep it
            await in_thread(release_freed_memory)


class ConcurrencyLimit:
    """At most `limit` generation requests at once (a stream counts until its last byte);
    the next gets a 429 with Retry-After instead of a queue that grows without bound."""

    def __init__(self, app, limit: int, paths: tuple[str, ...] = GENERATION_PATHS, on_reject=None):
        self.app = app
        self.limit = limit
        self.paths = paths
        self.on_reject = on_reject
        self.active = 0  # only touched on the event loop's thread

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        if self.active >= self.limit:
            if self.on_reject:
                self.on_reject("concurrency")
            await send_error(send, 429, f"this server already runs {self.active} generation requests, its limit "
                                        "(--max-concurrent-requests); retry shortly or raise the limit",
                             "rate_limit_error", {"retry-after": "1"})
            return
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1
