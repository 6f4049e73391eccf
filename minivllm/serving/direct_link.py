"""A direct TCP link between the controller and one worker on another host.

The Ray backend uses Ray for what a cluster manager is good at (placing a worker on a node
with the resources, starting it, noticing that it or its node died) and this link for the
messages themselves: an actor call per step costs about a millisecond of CPU on each side
(measured: 1.4 ms per token in the controller and 1.7 ms in the actor, against 0.3 ms over
a socket), which on a small machine is taken from the step loop. Over this link a worker
speaks exactly as a local one does: the same length-prefixed JSON (transport.Endpoint).

The controller listens on a port of its own node's address, one listener per worker, and
tells the actor the address and a one-time key through Ray. The worker proves it holds the
key with an HMAC of a random challenge, so nothing else on the network can pose as it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import threading
from multiprocessing.connection import Connection

from minivllm.serving.transport import Endpoint

CHALLENGE_BYTES = 32
HANDSHAKE_TIMEOUT_S = 5.0


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the other side closed the connection during the handshake")
        data += chunk
    return data


def _proof(key: bytes, challenge: bytes) -> bytes:
    return hmac.new(key, challenge, hashlib.sha256).digest()


def _endpoint_of(sock: socket.socket) -> Endpoint:
    # Token events are small and latency-bound: never let Nagle hold one back for an ACK.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(None)  # back to blocking: Connection reads the raw fd
    return Endpoint(Connection(sock.detach()))


class DirectListener:
    """The controller's side: accepts the one worker that proves it holds `key`."""

    def __init__(self, host: str):
        self.key = os.urandom(32)
        self._server = socket.create_server((host, 0))
        self._server.settimeout(0.5)  # so that close() ends the accepting thread promptly
        self._closed = False
        self.address = (host, self._server.getsockname()[1])
        self.accepted = threading.Event()
        self._lock = threading.Lock()
        self.endpoint: Endpoint | None = None
        threading.Thread(target=self._accept, name=f"minivllm-direct-accept-{self.address[1]}", daemon=True).start()

    def _accept(self) -> None:
        while not self.accepted.is_set() and not self._closed:
            try:
                sock, _ = self._server.accept()
            except socket.timeout:
                continue
            except OSError:  # closed
                return
            # Each handshake on its own thread: a client that connects and says nothing
            # (a port scanner) must not hold the real worker back for HANDSHAKE_TIMEOUT_S.
            threading.Thread(target=self._handshake, args=(sock,), daemon=True,
                             name=f"minivllm-direct-handshake-{self.address[1]}").start()
        self.close()

    def _handshake(self, sock: socket.socket) -> None:
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT_S)
            challenge = os.urandom(CHALLENGE_BYTES)
            sock.sendall(challenge)
            if not hmac.compare_digest(_recv_exactly(sock, 32), _proof(self.key, challenge)):
                raise ConnectionError("wrong key")
            with self._lock:
                if self.accepted.is_set():
                    raise ConnectionError("a worker is already connected")
                sock.sendall(b"ok")
                self.endpoint = _endpoint_of(sock)
                self.accepted.set()
        except OSError:
            sock.close()  # not our worker, or it gave up

    def close(self) -> None:
        self._closed = True
        try:
            self._server.close()
        except OSError:
            pass


def connect(address: tuple[str, int], key: bytes, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> Endpoint:
    """The worker's side; raises OSError when the controller cannot be reached from here."""
    sock = socket.create_connection(tuple(address), timeout=timeout_s)
    try:
        challenge = _recv_exactly(sock, CHALLENGE_BYTES)
        sock.sendall(_proof(key, challenge))
        if _recv_exactly(sock, 2) != b"ok":
            raise ConnectionError("the controller refused the handshake")
    except OSError:
        sock.close()
        raise
    return _endpoint_of(sock)
