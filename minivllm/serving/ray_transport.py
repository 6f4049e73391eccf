"""The Ray transport: each worker is a Ray actor, placed by Ray on any node of a cluster.

`Cluster(..., backend="ray", ray_address=...)` builds its workers through `RayBackend`;
everything above the transport (WorkerHandle, the router, the ledger, the HTTP API,
metrics and widgets) is the same as for local processes. Per worker:

- resources: `cpu:N` asks Ray for N CPUs (and runs N torch threads), `gpu` for one GPU and
  one CPU (the worker spins a core waiting on its GPU); Ray sets CUDA_VISIBLE_DEVICES, so
  the worker's device is always cuda:0 inside the actor;
- placement: `node=ADDR:...` pins the worker to a node (ADDR is its IP, or the first 8+
  hex digits of its node id, for several nodes on one host); without it Ray spreads the
  workers over the nodes. A restart goes back to the named node while it is alive, and
  anywhere with the resources once it is not;
- messages: over a direct TCP link from the actor to a listener of this transport
  (direct_link.py), as a local worker's socket carries them. Where the actor cannot reach
  the controller (a driver behind NAT through Ray Client), or the link is turned off
  (MINIVLLM_RAY_DIRECT=0), through Ray: `send` is then a fire-and-forget actor call
  carrying a sequence number, and `recv` hands out the batches of a long poll
  (ray_actor.py). The worker always speaks first, so its first message tells which link
  it took; anything sent before that waits here;
- death: one poll stays in flight on either link. When it fails (the actor was killed,
  its process died, its node went away), or the direct link closes, the transport closes
  at once and the handle fails every request the worker held. An unreachable actor is
  also killed, so it cannot come back and answer for failed requests.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import sys
import threading
import time
from dataclasses import dataclass

from minivllm.errors import ConfigError, MinivllmError
from minivllm.serving.inference_devices import InferenceDevice
from minivllm.serving.transport import TransportClosed, WorkerTransport

# How long one poll waits on the actor for something to send. The worker's heartbeat comes
# every 0.5 s, so a poll rarely waits this long; the value only bounds idle calls.
POLL_WAIT_S = 2.0
# On the direct link, how often recv looks at that poll for news of a death from Ray (a
# killed process closes the link by itself; a vanished node only shows up in Ray).
WATCH_EVERY_S = 0.5
# How long a closed direct link waits for Ray to say why (the error the requests get).
DEATH_REASON_WAIT_S = 1.0
# Ray's authentication mode, read from the environment only (docs.ray.io: token-auth).
RAY_AUTH_MODE = "RAY_AUTH_MODE"


class RayUnavailable(MinivllmError):
    """Ray is not installed, or its cluster cannot be reached."""


def import_ray():
    try:
        import ray
    except ImportError:
        raise RayUnavailable("the Ray backend needs Ray: pip install 'minivllm[ray]' (or pip install ray)") from None
    return ray


def connect(address: str | None) -> bool:
    """Join the Ray cluster at `address` ("auto": the one this machine belongs to or
    RAY_ADDRESS names; "ray://host:10001": through Ray Client; None: start a private local
    instance) unless this process already joined one. True when this call joined it."""
    if address is None:
        choose_private_auth_mode()
    ray = import_ray()
    if ray.is_initialized():
        return False
    # "local" always starts a new instance; plain None would join whatever a stale
    # /tmp/ray/ray_current_cluster names. Its workers run at normal priority, so that the
    # step loop's thread can leave Ray's nice 15 (ray_actor._normal_priority); and it
    # starts no idle workers ahead of time: our actors never run plain tasks, and each idle
    # worker costs a hundredth of a core, taken from the step loop on a small machine.
    private = {"worker_niceness": 0, "enable_worker_prestart": False, "prestart_worker_first_driver": False}
    extra = {"include_dashboard": False, "_system_config": private} if address is None else {}
    try:
        ray.init(address=address or "local", namespace="minivllm", logging_level="WARNING", **extra)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise RayUnavailable(f"cannot join the Ray cluster at {address!r}: {exc}. Start one with `ray start --head` "
                             "(and `ray start --address HEAD:6379` on each other node), or pass ray_address=None "
                             "for a local one") from None
    return True


def choose_private_auth_mode() -> None:
    """Token authentication for the private local instance, chosen explicitly.

    A new local `ray.init()` (Ray 2.59 on) turns token authentication on by itself when
    RAY_AUTH_MODE is unset, and logs "Token authentication is enabled for this Ray cluster"
    to stderr each time (the pink line under a notebook cell). RAY_AUTH_MODE is the one
    setting Ray documents for this (the environment only: Ray refuses it in _system_config),
    and Ray stays silent when it is set. We set it to the mode Ray would pick itself, token,
    in this process's environment (which the instance's processes inherit); a value the
    user set wins. Ray reads the mode once, when it is imported, so this happens only
    before that: where something imported Ray earlier, Ray chooses, and warns, as before
    (setting it then would leave this process on "disabled" and its new GCS on "token",
    which refuses it). Joining an existing cluster leaves the mode alone: that cluster's
    mode is its operator's choice."""
    if "ray" not in sys.modules:
        os.environ.setdefault(RAY_AUTH_MODE, "token")


def alive_nodes() -> list[dict]:
    ray = import_ray()
    return [n for n in ray.nodes() if n.get("Alive")]


def find_node(spec: str, nodes: list[dict] | None = None) -> dict:
    """The one alive node that `spec` names: its IP, or a prefix (8+ hex digits) of its id."""
    nodes = alive_nodes() if nodes is None else nodes
    text = spec.strip().lower()
    by_id = [n for n in nodes if len(text) >= 8 and n["NodeID"].lower().startswith(text)]
    by_ip = [n for n in nodes if n.get("NodeManagerAddress") == text]
    matches = by_id or by_ip
    listing = ", ".join(f"{n['NodeManagerAddress']} (id {n['NodeID'][:12]})" for n in nodes) or "none"
    if not matches:
        raise ConfigError("inference_device", f"node={spec}", f"no alive Ray node has that IP or id; nodes: {listing}")
    if len(matches) > 1:
        raise ConfigError("inference_device", f"node={spec}", f"{len(matches)} nodes share that address (several "
                          f"nodes on one host): name one by its id instead; nodes: {listing}")
    return matches[0]


@dataclass(frozen=True)
class Resources:
    cpus: float
    gpus: float

    def fits(self, node: dict) -> bool:
        total = node.get("Resources", {})
        return total.get("CPU", 0) >= self.cpus and total.get("GPU", 0) >= self.gpus

    def __str__(self) -> str:
        return f"{self.cpus:g} CPU" + (f" and {self.gpus:g} GPU" if self.gpus else "")


def resources_of(device: InferenceDevice) -> Resources:
    if device.kind == "cuda":
        return Resources(cpus=1, gpus=1)
    return Resources(cpus=float(device.threads or 1), gpus=0)


class RayBackend:
    """What a Cluster needs to start workers as actors: a transport factory per device."""

    def __init__(self, address: str | None, direct: bool | None = None):
        """`direct`: offer each actor a direct TCP link for its messages (default: yes,
        unless MINIVLLM_RAY_DIRECT=0); without it, or where it fails, messages go through Ray."""
        self.address = address
        self.direct = os.environ.get("MINIVLLM_RAY_DIRECT", "1") != "0" if direct is None else direct
        self._joined = False
        self.ensure_connected()
        self._actor_class = import_ray().remote(max_concurrency=4, max_restarts=0)(_actor_class())

    def ensure_connected(self) -> None:
        self._joined = connect(self.address) or self._joined

    def close(self) -> None:
        """Leave the Ray cluster if this backend joined it (the cluster itself goes on, but
        for a private local instance, which ends with it)."""
        if self._joined:
            import_ray().shutdown()
            self._joined = False

    def check_devices(self, devices: list[InferenceDevice]) -> None:
        """Fail before any actor starts when a named node is unknown or no node could ever
        hold a worker (a request Ray would otherwise leave pending forever)."""
        nodes = alive_nodes()
        for d in devices:
            need = resources_of(d)
            if d.node is not None:
                node = find_node(d.node, nodes)
                if not need.fits(node):
                    raise ConfigError(
                        "inference_device",
                        f"node={d.node}",
                        f"worker {d.name} needs {need}; that node "
                        f"has {node['Resources'].get('CPU', 0):g} CPU and {node['Resources'].get('GPU', 0):g} GPU",
                    )
            elif not any(need.fits(n) for n in nodes):
                raise ConfigError("inference_device", d.name, f"needs {need}, and no node of the Ray cluster has that "
                                  f"much in all ({len(nodes)} nodes); add a node or ask for fewer threads")

    def transport_factory(self, device: InferenceDevice):
        def make(module: str, config: dict, *, name: str) -> RayTransport:
            return RayTransport(self._actor_class, config, name=name, device=device, direct=self.direct)
        return make


def _actor_class():
    from minivllm.serving.ray_actor import WorkerActor

    return WorkerActor


class RayTransport(WorkerTransport):
    def __init__(self, actor_class, config: dict, *, name: str, device: InferenceDevice, direct: bool = True):
        ray = import_ray()
        self._ray = ray
        self.name = name
        self._send_lock = threading.Lock()
        self._seq = itertools.count()
        self._buffer: collections.deque[str] = collections.deque()
        self._early: list[dict] = []  # sent before the worker's first message chose the link
        self._pending = None
        self._closed_reason: str | None = None
        self._ended = False
        self._actor_class, self._config, self._device = actor_class, config, device
        self._offer_direct = direct
        self._listener = None
        self._link: str | None = None  # "direct" or "ray", once the worker has spoken
        self._direct = None  # its Endpoint
        self._watched_at = 0.0
        self._replacements_left = 1
        self._spawn(self._strategy(device))

    def _spawn(self, strategy) -> None:
        from minivllm.serving.direct_link import DirectListener

        need = resources_of(self._device)
        options = {"num_cpus": need.cpus, "num_gpus": need.gpus, "scheduling_strategy": strategy}
        offer = None
        if self._offer_direct:
            self._listener = DirectListener(self._ray.util.get_node_ip_address())
            offer = {"address": list(self._listener.address), "key": self._listener.key}
        self._actor = self._actor_class.options(**options).remote(self._config, self.name, offer)
        self._location_ref = self._actor.location.remote()  # answers once Ray has placed the actor
        self._location: dict = {}
        self._pending = None
        with self._send_lock:
            self._seq = itertools.count()  # a new actor numbers from 0

    def _strategy(self, device: InferenceDevice):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if device.node is None:
            return "SPREAD"
        try:
            node = find_node(device.node)
        except ConfigError:  # the named node is gone (a restart after it died): anywhere that fits
            return "SPREAD"
        return NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)

    # -- WorkerTransport --------------------------------------------------------------------------

    def send(self, msg: dict) -> None:
        if self._closed_reason is not None:
            raise TransportClosed(self._closed_reason)
        if self._link == "direct":
            self._direct.send(msg)
            return
        with self._send_lock:  # sequence numbers in submission order
            if self._link is None:
                self._early.append(msg)
            else:
                self._actor.deliver.remote(next(self._seq), msg)

    def _choose(self, link: str) -> None:
        """The worker has spoken on `link`: from now on everything goes that way."""
        with self._send_lock:
            self._link = link
            if link == "direct":
                self._direct = self._listener.endpoint
            elif self._listener is not None:
                self._listener.close()
            early, self._early = self._early, []
        for msg in early:
            self.send(msg)

    def recv(self, timeout: float | None) -> dict | None:
        if self._buffer:
            return json.loads(self._buffer.popleft())
        if self._closed_reason is not None:
            raise TransportClosed(self._closed_reason)
        if self._ended and self._link != "direct":  # (a direct link ends at its own EOF)
            self._closed_reason = "the worker ended"
            raise TransportClosed(self._closed_reason)
        if self._link is None and self._listener is not None and self._listener.accepted.is_set():
            self._choose("direct")
        if self._link == "direct":
            return self._recv_direct(timeout)
        # Until the worker speaks, look at the listener between short waits on the poll.
        wait = timeout if self._link == "ray" or self._listener is None else min(timeout or 0.05, 0.05)
        return self._poll(wait)

    def _recv_direct(self, timeout: float | None) -> dict | None:
        now = time.monotonic()
        if now - self._watched_at >= WATCH_EVERY_S:
            self._watched_at = now
            self._poll(0)  # Ray's word on the actor; raises TransportClosed when it died
        try:
            return self._direct.recv(timeout)
        except TransportClosed as exc:
            why = f"its direct link closed ({exc})"
        # The worker ended, or its process is gone: Ray usually knows which within a moment.
        deadline = time.monotonic() + DEATH_REASON_WAIT_S
        while not self._ended and time.monotonic() < deadline:
            self._poll(deadline - time.monotonic())  # raises TransportClosed with Ray's reason
        if self._ended:
            self._closed_reason = "the worker ended"
        else:
            self._closed_reason = why
            self.kill()
        raise TransportClosed(self._closed_reason)

    def _poll(self, wait: float | None) -> dict | None:
        """Keep one poll in flight; on the Ray link it brings the worker's messages, on the
        direct link only its end (or Ray's report of its death)."""
        if self._pending is None:
            self._pending = self._actor.poll.remote(POLL_WAIT_S)
        ready, _ = self._ray.wait([self._pending], timeout=wait)
        if not ready:
            return None
        ref, self._pending = self._pending, None
        try:
            batch, ended = self._ray.get(ref)
        except (self._ray.exceptions.RayActorError, self._ray.exceptions.ActorUnavailableError) as exc:
            if self._link is None and self._replacements_left and "node" in str(exc).lower():
                self._replacements_left -= 1  # placed on a node that died before the worker started
                self.kill()
                self._spawn("SPREAD")
                return None
            self._lost(exc)
            raise TransportClosed(self._closed_reason) from None
        if batch and self._link is None:
            self._choose("ray")
        self._ended = ended
        self._buffer.extend(batch)
        return json.loads(self._buffer.popleft()) if self._buffer and self._link == "ray" else None

    def _lost(self, exc: Exception) -> None:
        text = " ".join(str(exc).split())
        self._closed_reason = f"its Ray actor is gone: {type(exc).__name__}: {text[:400]}"
        self.kill()  # an unreachable actor must not come back and answer for failed requests

    def alive(self) -> bool:
        return self._closed_reason is None

    def exit_code(self) -> int | None:
        return None

    def describe_exit(self) -> str:
        return self._closed_reason or "its Ray actor ended"

    def kill(self) -> None:
        try:
            self._ray.kill(self._actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        self._release_link()

    def _release_link(self) -> None:
        if self._listener is not None:
            self._listener.close()
        if self._direct is not None:
            self._direct.close()

    def close(self, timeout: float = 10.0) -> None:
        if self._closed_reason is None:
            try:
                self._ray.get(self._actor.join.remote(timeout), timeout=timeout + 5)
            except Exception:  # noqa: BLE001 - dead already, or it would not stop: killed below
                pass
        self._closed_reason = self._closed_reason or "closed"
        self.kill()

    @property
    def location(self) -> dict:
        """The actor's node, host, pid and GPU ids; empty until Ray has placed it (never blocks:
        snapshots and widgets read this)."""
        if not self._location and self._location_ref is not None:
            ready, _ = self._ray.wait([self._location_ref], timeout=0)
            if ready:
                try:
                    self._location = self._ray.get(self._location_ref)
                except Exception:  # noqa: BLE001 - the actor died before it answered
                    pass
                self._location_ref = None
        return {**self._location, "link": self._link} if self._location else {}

    @property
    def pid(self) -> int | None:
        return self.location.get("pid")
