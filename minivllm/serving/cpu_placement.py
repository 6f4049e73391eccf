"""Cores of their own for a local cluster's workers (`Cluster(pin_cpus=True)`, opt-in).

Why: a CPU worker's step is a chain of parallel regions, each as slow as its slowest
thread. Beside busy neighbours (a GPU worker's step loop spins a core, the controller
streams tokens), one of its threads sharing a core, or a core's second hyperthread, with
one of them stretches every region, far beyond that core's share of the work. On the H100
machine two split requests decoding on an 8-thread CPU worker ran 3x slower than the same
engine alone (docs/disaggregation.md); `scripts/cpu_imported_rows.py --neighbours --pin`
measures whether cores of its own undo that.

The plan: each CPU worker, in list order, gets as many CPUs as it runs threads, one per
physical core first (a core's second hyperthread only once every core has one taken), and
the GPU workers share the CPUs left (all of them where none are left). The controller's
own process is not moved: it is the user's (often a notebook kernel). Off by default until
the probe and a burst on the GPU machine say it pays.
"""

from __future__ import annotations

import dataclasses
import os

from minivllm.errors import ConfigError


def read_siblings(cpu: int) -> str:
    """The CPUs sharing `cpu`'s physical core, as Linux lists them ("0,8" or "0-1"); the CPU
    itself where the topology file is missing."""
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
            return f.read().strip()
    except OSError:
        return str(cpu)


def cpus_physical_first(allowed: list[int] | None = None, siblings=read_siblings) -> list[int]:
    """`allowed` (default: the CPUs this process may use), every physical core's first CPU
    before any core's second."""
    cores: dict[str, list[int]] = {}
    for cpu in sorted(os.sched_getaffinity(0) if allowed is None else allowed):
        cores.setdefault(siblings(cpu), []).append(cpu)
    rank = {cpu: i for cpus in cores.values() for i, cpu in enumerate(cpus)}
    return sorted(rank, key=lambda cpu: (rank[cpu], cpu))


def plan_cpus(devices: list, order: list[int] | None = None, *, backend: str = "local") -> list:
    """`devices` (InferenceDevice) with their `cpus` filled in, by the plan above; `order`:
    the CPUs to hand out, best first (default `cpus_physical_first()`)."""
    if backend != "local":
        raise ConfigError("pin_cpus", True, "pins a local cluster's workers; on Ray each node places its own")
    order = cpus_physical_first() if order is None else list(order)
    wanted = sum(d.threads for d in devices if d.kind == "cpu")
    if wanted > len(order):
        raise ConfigError("pin_cpus", True, f"the CPU workers run {wanted} threads but this process may use "
                          f"{len(order)} CPUs: give fewer threads (cpu:N) or leave pin_cpus off")
    taken = 0
    out = []
    for d in devices:
        if d.kind == "cpu":
            out.append(dataclasses.replace(d, cpus=tuple(sorted(order[taken:taken + d.threads]))))
            taken += d.threads
        else:
            out.append(d)
    rest = tuple(sorted(order[taken:])) or tuple(sorted(order))
    return [d if d.kind == "cpu" else dataclasses.replace(d, cpus=rest) for d in out]


def apply_cpus(cpus) -> None:
    """In the worker, before its torch threads start (they inherit the mask they are created
    with): run on `cpus` only; nothing when None."""
    if cpus:
        os.sched_setaffinity(0, set(cpus))
