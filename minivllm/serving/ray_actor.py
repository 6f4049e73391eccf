"""The worker side of the Ray transport: one Ray actor hosts one ordinary worker.

The actor runs `worker.serve_worker` on a thread of its own. Its messages travel over a
direct TCP link to the controller (direct_link.py) when the controller gave one and this
node can reach it: the same length-prefixed JSON as a local worker's socket, at a local
worker's cost per token. Otherwise they travel through Ray itself, over a `QueueEndpoint`:
the controller's messages arrive through `deliver` (numbered, since a threaded actor may
run two calls out of order) and the worker's leave through `poll`, a long poll that
returns everything queued since the last one, so a step's token events travel in one
batch and no token pays a round trip of its own. Either way `poll` stays in flight from
the controller, which is how it learns from Ray that this actor or its node died.

Before the worker starts, the model is resolved by name on this node (the registry, the
PyPI mirrors, the HF cache or a path) and checked against the controller's file; a node
without it, or with a different file, fails this worker with an error naming the node.
"""

from __future__ import annotations

import collections
import json
import os
import socket
import threading

from minivllm.serving.transport import TransportClosed


class QueueEndpoint:
    """The worker's endpoint inside the actor: `send`/`recv` as over a socket."""

    def __init__(self):
        self._cond = threading.Condition()
        self._outbox: collections.deque[str] = collections.deque()
        self._inbox: dict[int, dict] = {}
        self._next_in = 0
        self._ended = False  # the worker thread returned
        self._closed = False  # the controller said goodbye, or the actor is going

    # -- the worker's side
    def send(self, msg: dict) -> None:
        data = json.dumps(msg, separators=(",", ":"))
        with self._cond:
            if self._closed:
                raise TransportClosed("the controller closed this worker's link")
            self._outbox.append(data)
            self._cond.notify_all()

    def recv(self, timeout: float | None) -> dict | None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._next_in in self._inbox or self._closed, timeout):
                return None
            if self._next_in not in self._inbox:
                raise TransportClosed("the controller closed this worker's link")
            msg = self._inbox.pop(self._next_in)
            self._next_in += 1
            return msg

    # -- the actor methods' side
    def deliver(self, seq: int, msg: dict) -> None:
        with self._cond:
            self._inbox[seq] = msg
            self._cond.notify_all()

    def take(self, wait_s: float) -> tuple[list[str], bool]:
        """Everything the worker sent since the last call, waiting up to `wait_s` for
        something; and whether the worker has ended (nothing more will come)."""
        with self._cond:
            self._cond.wait_for(lambda: self._outbox or self._ended, wait_s)
            batch = list(self._outbox)
            self._outbox.clear()
            return batch, self._ended and not self._outbox

    def ended(self) -> None:
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def _normal_priority() -> int:
    """Undo Ray's worker niceness (15, so that raylets stay responsive) for this thread, the
    step loop's; the local backend's workers run at normal priority, and at nice 15 every
    other process on the machine preempts the engine. Linux keeps niceness per thread, so
    Ray's own RPC threads in this process stay nice. Lowering niceness needs CAP_SYS_NICE
    (root) unless the cluster was started with worker_niceness 0; without it the value stays
    as Ray set it. Returns the niceness in effect."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    except OSError:
        pass
    return os.getpriority(os.PRIO_PROCESS, 0)


class WorkerActor:
    """Wrapped with `ray.remote` by ray_transport (resources and placement per worker)."""

    def __init__(self, config: dict, name: str, direct: dict | None = None):
        """`direct`: the controller's listener ({"address": [host, port], "key": bytes}),
        or None to speak through Ray only."""
        os.environ["MINIVLLM_WORKER_NAME"] = name
        self.name = name
        self.endpoint = QueueEndpoint()
        self.placement = self._where()
        self._thread = threading.Thread(target=self._serve, args=(config, direct), name="minivllm-ray-worker",
                                        daemon=True)
        self._thread.start()

    def _where(self) -> dict:
        import ray

        ctx = ray.get_runtime_context()
        node_id = ctx.get_node_id()
        ip = ray.util.get_node_ip_address()
        return {"backend": "ray", "node_id": node_id, "node_ip": ip, "host": socket.gethostname(), "pid": os.getpid(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "where": f"Ray node {ip} ({node_id[:8]})"}

    def _serve(self, config: dict, direct: dict | None) -> None:
        from minivllm.serving.worker import serve_worker

        self.placement["niceness"] = _normal_priority()
        endpoint = self._link(direct)
        try:
            config = {**config, "placement": self.placement}
            problem = self._resolve_models(config)
            if problem is not None:
                endpoint.send({"op": "failed", "error": problem})
                return
            serve_worker(endpoint, config)
        except TransportClosed:
            pass
        finally:
            if endpoint is not self.endpoint:
                endpoint.close()
            self.endpoint.ended()

    def _link(self, direct: dict | None):
        """The direct link to the controller when it offered one and it answers from this
        node, else the queue endpoint (messages through Ray); `placement["link"]` says which."""
        if direct is None:
            self.placement["link"] = "ray"
            return self.endpoint
        from minivllm.serving import direct_link

        address = tuple(direct["address"])
        try:
            endpoint = direct_link.connect(address, direct["key"])
        except OSError as exc:
            self.placement["link"] = f"ray (the controller's {address[0]}:{address[1]} is unreachable from here: {exc})"
            return self.endpoint
        self.placement["link"] = "direct"
        return endpoint

    def _resolve_models(self, config: dict) -> str | None:
        """Swap the model names for this node's files; the reason, if that fails."""
        from minivllm.errors import MinivllmError
        from minivllm.models import resolve_model
        from minivllm.models.cache import quick_fingerprint

        where = self.placement["where"]
        for key in ("model", "draft_model"):
            spec = config.get(f"{key}_spec")
            if not spec:
                continue
            try:
                path = resolve_model(spec, progress=False)
            except MinivllmError as exc:
                return f"{where} has no model {spec!r}: {exc}"
            expected = config.get(f"{key}_fingerprint")
            found = quick_fingerprint(path)
            if expected and found != expected:
                return (f"{where} has a different file for model {spec!r} ({path}: {found}; the controller's is "
                        f"{expected}): copy the controller's file there, or pull the same version on every node")
            config[key] = str(path)
        return None

    # -- called by RayTransport ---------------------------------------------------------------

    def deliver(self, seq: int, msg: dict) -> None:
        self.endpoint.deliver(seq, msg)

    def poll(self, wait_s: float) -> tuple[list[str], bool]:
        return self.endpoint.take(wait_s)

    def location(self) -> dict:
        return self.placement

    def join(self, timeout_s: float) -> bool:
        """Wait for the worker to finish after a shutdown; True when it has."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            return False
        self.endpoint.close()
        return True
