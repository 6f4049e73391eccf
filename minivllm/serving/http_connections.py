"""Connection guards below the ASGI app: a header-read timeout and a cap on open connections.

uvicorn times out idle keep-alive connections only after a response; a client that
connects and then sends its request line and headers one byte at a time (slowloris) is
never timed out, and nothing bounds how many such sockets are open. Both are fixed here
on uvicorn's own h11 protocol class (`uvicorn.Config(http=...)` takes a class):

- `header_timeout_s`: once a connection is waiting for a request (just accepted, or
  after a response on a kept-alive connection), the request's headers must be complete
  within this many seconds, or the server answers 408 and closes it. Its body then gets
  as long again (`http_guards.BodySizeLimit`, same 408 and close); a response, however
  long it streams, is not limited.
- `max_connections`: a connection accepted while this many are open first evicts the
  connection that has waited longest for a request (a kept-alive one between requests,
  or one whose headers are still incomplete), closed silently as a keep-alive timeout
  closes it; only when every open connection is busy with a request does the new one
  get a 503 with Retry-After, closed at once before anything is read from it. A flood
  of idle sockets can thus neither exhaust file descriptors nor lock new clients out
  (issue 39: 512 idle keep-alive sockets got /health itself a 503 for up to 10 s).

The counters (`stats`) say how many connections each guard closed.
"""

from __future__ import annotations

import asyncio
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from minivllm.serving.http_guards import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS

logger = logging.getLogger("minivllm.http")


def _raw_response(status: str, message: str, extra: str = "") -> bytes:
    body = json.dumps({"error": {"message": message, "type": "rate_limit_error" if status.startswith("503")
                                 else "invalid_request_error", "param": None, "code": None}}).encode()
    head = (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n{extra}\r\n")
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the two guards; `guarded_protocol` makes a subclass with
    the limits (and its own counters) filled in."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    stats: dict[str, int] = {"header_timeouts": 0, "refused": 0, "evicted": 0}

    _header_timer: asyncio.TimerHandle | None = None
    _refused = False
    waiting_since: float | None = None  # loop time since which it waits for a request's headers

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections and not self._evict_idle():
            self._refused = True
            self.transport = transport  # connection_lost closes it again
            self.stats["refused"] += 1
            transport.write(_raw_response(
                "503 Service Unavailable", f"this server already has {len(self.connections)} open connections, its "
                "limit (--max-connections); retry shortly or raise the limit", "retry-after: 1\r\n"))
            transport.close()
            return
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the request's headers are in
            self._cancel_header_timer()
            self.waiting_since = None

    def waiting_for_request(self) -> bool:
        return (self.waiting_since is not None and not self.transport.is_closing()
                and self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE)

    def _evict_idle(self) -> bool:
        """Close the open connection that has waited longest for a request; False if none waits."""
        idle = [c for c in self.connections if isinstance(c, GuardedH11Protocol) and c.waiting_for_request()]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c.waiting_since)
        oldest.waiting_since = None
        oldest._cancel_header_timer()
        oldest.transport.close()  # leaves `connections` in its connection_lost
        self.stats["evicted"] += 1
        logger.info("closed an idle connection from %s to admit a new one (--max-connections %d)",
                    oldest.client, self.max_connections)
        return True

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer()  # the next request on this connection gets the same deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self.waiting_since = self.loop.time()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return  # a request is being served (pipelined); its completion re-arms the timer
        self.stats["header_timeouts"] += 1
        logger.info("closed a connection from %s: no complete request headers within %g s (--header-timeout)",
                    self.client, self.header_timeout_s)
        self.transport.write(_raw_response(
            "408 Request Timeout", f"the request headers did not arrive within {self.header_timeout_s:g} s "
            "(the server's --header-timeout); send the whole request at once"))
        self.transport.close()


def guarded_protocol(header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
                     max_connections: int = DEFAULT_MAX_CONNECTIONS) -> type[GuardedH11Protocol]:
    """A protocol class for `uvicorn.Config(http=...)` with these limits and fresh counters."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {
        "header_timeout_s": float(header_timeout_s), "max_connections": int(max_connections),
        "stats": {"header_timeouts": 0, "refused": 0, "evicted": 0}})
