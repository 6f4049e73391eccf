"""The Ray backend's direct link: only a worker holding the one-time key gets through, and
what it sends arrives as the local protocol does."""

import socket

import pytest

from minivllm.serving.direct_link import CHALLENGE_BYTES, DirectListener, connect


def test_a_worker_with_the_key_speaks_both_ways():
    listener = DirectListener("127.0.0.1")
    worker = connect(listener.address, listener.key)
    assert listener.accepted.wait(5)
    worker.send({"type": "ready", "n": 1})
    assert listener.endpoint.recv(timeout=5) == {"type": "ready", "n": 1}
    listener.endpoint.send({"type": "submit", "ids": [1, 2, 3]})
    assert worker.recv(timeout=5) == {"type": "submit", "ids": [1, 2, 3]}
    worker.close()
    listener.endpoint.close()


def test_a_wrong_key_is_refused_and_the_real_worker_still_gets_in():
    listener = DirectListener("127.0.0.1")
    with pytest.raises(ConnectionError):
        connect(listener.address, b"x" * 32)
    assert not listener.accepted.is_set()
    # A client that connects and says nothing (a port scanner) does not block the worker.
    idle = socket.create_connection(listener.address)
    assert len(idle.recv(CHALLENGE_BYTES)) > 0
    worker = connect(listener.address, listener.key)
    assert listener.accepted.wait(10)
    worker.send({"type": "ready"})
    assert listener.endpoint.recv(timeout=5) == {"type": "ready"}
    idle.close()


def test_the_listener_stops_accepting_once_its_worker_is_in():
    listener = DirectListener("127.0.0.1")
    connect(listener.address, listener.key)
    assert listener.accepted.wait(5)
    with pytest.raises(OSError):
        connect(listener.address, listener.key, timeout_s=2)
