"""`--inference-device` values: which worker processes a cluster starts, and where.

    cpu        a CPU worker; torch threads: the cores left after one per GPU worker (it
               spins a core waiting on its GPU) and, on 8+ cores, one for the controller,
               minus those given as cpu:N, split between the other CPU workers. Oversubscribing cores is far worse than
               using fewer: every parallel region waits for its slowest thread
    cpu:N      a CPU worker with N torch threads
    gpu        the next CUDA index no other entry has claimed (0, then 1, ...)
    cuda       same as gpu
    cuda:N     CUDA device N, claimed explicitly

Explicit `cuda:N` entries are claimed first, so `gpu cuda:0` gives cuda:1 then cuda:0.
Parsing happens in the controller, before any process starts, so a bad list fails fast
with an error naming the entry.

On the Ray backend (`backend="ray"`) the entries ask Ray for resources instead:

    cpu, cpu:N        a worker with 1 (or N) CPUs of some node, and that many torch threads
    gpu, cuda         a worker with one GPU (and one CPU) of some node; Ray picks the GPU
    node=ADDR:ENTRY   the same, on the node whose IP is ADDR, or whose id starts with ADDR
                      (8+ hex digits; several nodes on one host share an IP)

`cuda:N` is refused there: GPU indices are per node, and Ray assigns them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from minivllm.errors import ConfigError, DeviceError

_HELP = "expected cpu, cpu:THREADS, gpu, cuda or cuda:N"


@dataclass(frozen=True)
class InferenceDevice:
    kind: str  # "cpu" or "cuda"
    index: int | None = None  # CUDA index
    threads: int | None = None  # torch threads (CPU workers; GPU workers use 1)
    name: str = ""  # the worker's unique name: "cpu", "cpu#2", "cuda:0"
    node: str | None = None  # Ray backend: the node asked for (IP or node-id prefix); None: Ray picks
    cpus: tuple[int, ...] | None = None  # the CPUs it runs on, where pinned (cpu_placement.py); None: any

    @property
    def torch_device(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"

    def as_dict(self) -> dict:
        return {"kind": self.kind, "index": self.index, "threads": self.threads, "name": self.name,
                "torch_device": self.torch_device, "node": self.node,
                "cpus": None if self.cpus is None else list(self.cpus)}


def _parse_one(text: str) -> tuple[str, int | None, int | None]:
    spec = str(text).strip().lower()
    if spec == "cpu":
        return "cpu", None, None
    if spec.startswith("cpu:"):
        try:
            threads = int(spec[4:])
        except ValueError:
            raise ConfigError("inference_device", text, f"{_HELP}; THREADS must be an integer") from None
        if threads < 1:
            raise ConfigError("inference_device", text, "the thread count must be >= 1")
        return "cpu", None, threads
    if spec in ("gpu", "cuda"):
        return "cuda", None, None
    if spec.startswith("cuda:"):
        try:
            index = int(spec[5:])
        except ValueError:
            raise ConfigError("inference_device", text, _HELP) from None
        if index < 0:
            raise ConfigError("inference_device", text, "a CUDA index is >= 0")
        return "cuda", index, None
    raise ConfigError("inference_device", text, _HELP)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # respects container CPU sets
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _split_node(text: str) -> tuple[str | None, str]:
    spec = str(text).strip()
    if not spec.lower().startswith("node="):
        return None, spec
    node, sep, entry = spec[5:].partition(":")
    if not node or not sep or not entry:
        raise ConfigError(
            "inference_device", text, "expected node=ADDR:ENTRY, e.g. node=10.0.0.2:cpu:4 or node=10.0.0.2:gpu"
        )
    return node, entry


def parse_ray_devices(specs: list[str]) -> list[InferenceDevice]:
    """The Ray backend's entries: resources to ask Ray for, on a named node or anywhere."""
    devices: list[InferenceDevice] = []
    seen: dict[str, int] = {}
    for text in specs:
        node, entry = _split_node(text)
        kind, index, threads = _parse_one(entry)
        if kind == "cuda" and index is not None:
            raise ConfigError("inference_device", text, "on the Ray backend give gpu (or node=ADDR:gpu): GPU indices "
                              "are per node and Ray assigns them")
        base = "cpu" if kind == "cpu" else "gpu"
        seen[base] = seen.get(base, 0) + 1
        name = base if seen[base] == 1 else f"{base}#{seen[base]}"
        # Inside its actor a GPU worker sees only the GPU Ray gave it, as cuda:0.
        devices.append(InferenceDevice(kind, 0 if kind == "cuda" else None, threads or 1, name, node))
    return devices


def parse_inference_devices(specs: list[str] | tuple[str, ...] | str, *, cuda_count: int | None = None,
                            cpu_cores: int | None = None, backend: str = "local") -> list[InferenceDevice]:
    """Resolve the whole list at once (claiming needs to see every entry)."""
    if isinstance(specs, str):
        specs = [specs]
    specs = list(specs)
    if not specs:
        raise ConfigError("inference_device", specs, "give at least one device, e.g. --inference-device cpu")
    if backend == "ray":
        return parse_ray_devices(specs)
    for s in specs:
        if _split_node(s)[0] is not None:
            raise ConfigError("inference_device", s, "node=... places a worker on a Ray node: start the cluster with "
                              "backend='ray' (serve --backend ray)")
    parsed = [_parse_one(s) for s in specs]
    wants_cuda = any(kind == "cuda" for kind, _, _ in parsed)
    count = cuda_count if cuda_count is not None else (cuda_device_count() if wants_cuda else 0)
    explicit = [idx for kind, idx, _ in parsed if kind == "cuda" and idx is not None]
    for spec, (kind, idx, _) in zip(specs, parsed):
        if kind == "cuda" and idx is not None and idx >= count:
            raise DeviceError(
                f"inference device {spec!r} does not exist: this machine has "
                + (f"cuda:0..cuda:{count - 1}" if count else "no CUDA device")
                + "; use --inference-device cpu"
            )
    duplicates = {i for i in explicit if explicit.count(i) > 1}
    if duplicates:
        raise ConfigError("inference_device", f"cuda:{min(duplicates)}", "is listed twice; each GPU runs one worker")
    claimed = set(explicit)
    cpu_entries = sum(1 for kind, _, _ in parsed if kind == "cpu")
    cores = cpu_cores or available_cores()
    gpu_entries = len(parsed) - cpu_entries
    reserved = gpu_entries + (1 if cores >= 8 else 0)
    pinned = sum(threads for kind, _, threads in parsed if kind == "cpu" and threads)
    unpinned = sum(1 for kind, _, threads in parsed if kind == "cpu" and not threads)
    default_threads = max(1, (cores - reserved - pinned) // max(1, unpinned))
    devices: list[InferenceDevice] = []
    cpu_seen = 0
    for spec, (kind, idx, threads) in zip(specs, parsed):
        if kind == "cpu":
            cpu_seen += 1
            name = "cpu" if cpu_seen == 1 else f"cpu#{cpu_seen}"
            devices.append(InferenceDevice("cpu", None, threads or default_threads, name))
            continue
        if idx is None:
            free = [i for i in range(count) if i not in claimed]
            if not free:
                raise DeviceError(f"inference device {spec!r}: no unclaimed CUDA device left (this machine has "
                                  f"{count}); remove a gpu entry or use --inference-device cpu")
            idx = free[0]
            claimed.add(idx)
        devices.append(InferenceDevice("cuda", idx, 1, f"cuda:{idx}"))
    return devices
