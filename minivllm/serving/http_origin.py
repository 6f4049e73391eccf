"""Without an API key, only this machine's own clients (or the named hosts) get in.

A server without `--api-key` trusts whoever can connect, and by default only this machine
can (it binds loopback). A web page in the user's browser runs on this machine too, and
can reach the server two ways the bind address does not stop (issue 39):

- a cross-site "simple" request: a page may POST `Content-Type: text/plain` to any URL
  without a CORS preflight; it cannot read the answer, but the POST has done its work
  (restarting a worker ends its streams);
- DNS rebinding: a page on `evil.example` re-points that name to 127.0.0.1 and then reads
  the server as same-origin; only the `Host` header still says `evil.example`.

So, when no key is set, every route but /health is refused (403) unless its `Host` is a
loopback name or address or one the operator allowed (`--allowed-host`), and unless its
`Origin`, if any (browsers send one on every cross-origin request and on every POST),
names such a host as well. A POST to an admin route (`/v1/cluster/...`) must also say
`Content-Type: application/json` or carry `X-Requested-With` (415 otherwise): a browser
cannot send either cross-site without a preflight, which this server never grants.

With a key, none of this applies: a page cannot know the key, and a request with it is
the operator's own (`ApiKeyGuard`).
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from minivllm.errors import quoted
from minivllm.serving.http_guards import OPEN_PATHS, send_error

LOOPBACK_NAMES = ("localhost",)
ADMIN_PREFIX = "/v1/cluster/"
WILDCARD_BINDS = ("0.0.0.0", "::", "")


def host_name(value: str) -> str:
    """The host of a `Host` header value or a URL's netloc: no port, no brackets, lower case."""
    value = value.strip().lower()
    if value.startswith("["):  # [::1]:8000
        return value[1:value.find("]")] if "]" in value else value
    if value.count(":") == 1:
        value = value.split(":", 1)[0]
    return value.rstrip(".")


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts_for(bind_host: str, allowed: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The configured hosts, plus the bind address itself when it names one address."""
    hosts = tuple(host_name(h) for h in allowed)
    bind = host_name(bind_host)
    return hosts + ((bind,) if bind not in WILDCARD_BINDS and bind not in hosts else ())


class LocalOnlyGuard:
    def __init__(self, app, allowed_hosts: tuple[str, ...] = (), open_paths: tuple[str, ...] = OPEN_PATHS,
                 on_reject=None):
        self.app = app
        self.allowed = frozenset(host_name(h) for h in allowed_hosts)
        self.open_paths = open_paths
        self.on_reject = on_reject

    def trusted(self, host: str) -> bool:
        return is_loopback(host) or host in self.allowed

    def refusal(self, scope) -> tuple[int, str] | None:
        headers = scope.get("headers") or []
        for name, value in headers:
            if name == b"host" and not self.trusted(host_name(value.decode("latin-1"))):
                return 403, (f"Host {quoted_header(value)} is not this server's: without --api-key it answers only "
                             "loopback names (localhost, 127.0.0.1, ::1) and the hosts given with --allowed-host "
                             "(a DNS-rebinding guard); add --allowed-host NAME or set --api-key")
            if name == b"origin":
                origin = value.decode("latin-1")
                netloc = urlsplit(origin).netloc if origin != "null" else ""
                if not netloc or not self.trusted(host_name(netloc)):
                    return 403, (f"cross-origin request from {quoted_header(value)} refused: without --api-key this "
                                 "server answers only pages served from loopback or a --allowed-host; call it from "
                                 "a script, or set --api-key")
        if scope["method"] == "POST" and scope["path"].startswith(ADMIN_PREFIX):
            names = {name for name, _ in headers}
            content_type = dict(headers).get(b"content-type", b"").split(b";")[0].strip().lower()
            if content_type != b"application/json" and b"x-requested-with" not in names:
                return 415, ("admin routes without --api-key need 'Content-Type: application/json' (or an "
                             "X-Requested-With header), which a web page cannot send cross-site without asking")
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            refused = self.refusal(scope)
            if refused is not None:
                if self.on_reject:
                    self.on_reject("origin")
                await send_error(send, refused[0], refused[1], "invalid_request_error")
                return
        await self.app(scope, receive, send)


def quoted_header(value: bytes) -> str:
    return quoted(value.decode("latin-1"))
