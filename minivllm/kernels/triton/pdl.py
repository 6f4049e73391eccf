"""Programmatic dependent launch (PDL, sm_90+) for the kernels of a decode step.

Why: a 7B decode step is about 360 launches in a row, each depending on the one before.
Without PDL a kernel's programs are scheduled only after the previous kernel has fully
drained, so every boundary costs the launch and the ramp-up of the next grid on top of
the previous one's tail. With PDL (`launch_pdl=True`) the next grid is scheduled once
every program of the running one has passed its `griddepcontrol.launch_dependents`, and
it waits for that kernel's completion (and memory flush) at its own
`griddepcontrol.wait`. llama.cpp launches its CUDA kernels this way on Hopper.

The rule every kernel here follows (`wait_for_producers`, its first statement):

    gdc_wait()                # the previous kernel has finished; its writes are visible
    gdc_launch_dependents()   # only now may the next kernel's programs be scheduled

Waiting before anything is read or written keeps a kernel ordered after every earlier
one (each kernel starts after its predecessor has passed the same wait, so the ordering
is transitive), and triggering only after the wait means at most two grids overlap, the
newer one parked at its wait. The one exception: memory no kernel of the step writes may
be read before the wait, and the tiled GEMV reads its first trip of weights there
(`early_weights`), so their DRAM latency overlaps the producer's tail. A launch that is
not PDL (torch ops, cuBLAS) is ordered as always. Numerics are untouched: the same
programs compute the same values.

`pdl_args(device)` is the one switch: the launch keywords that turn both halves on
together (never one without the other: a PDL launch of a kernel without the wait would
race its producer). On only where the GPU profile allows it (`gpu_profile.py`: sm_90+,
so never on the T4 profile), unless MINIVLLM_PDL=0 turns it off. On by default since the
h100-s49 sitting: 7B batch-1 decode 285.0 against 280.1 tok/s without it, 0.5B 948.6 against
939.3, batched rows level (benchmarks/results/h100-s49-vs-llama-cpp.md).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from minivllm.kernels.gpu_profile import gpu_profile, triton_interpreting

PDL_ENV = "MINIVLLM_PDL"
EARLY_ENV = "MINIVLLM_GEMV_EARLY_LOAD"


@triton.jit
def wait_for_producers(PDL: tl.constexpr):
    """A PDL-launched kernel's first step (see the module docstring); nothing when PDL is off."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def pdl_requested() -> bool:
    return os.environ.get(PDL_ENV, "1").strip() != "0"


def _enabled(device_type: str, index: int | None) -> bool:
    if not pdl_requested() or device_type != "cuda" or triton_interpreting():
        return False
    import torch

    return gpu_profile(torch.device(device_type, index)).programmatic_launch


_ON = {"PDL": True, "launch_pdl": True}
_DECIDED: dict = {}  # torch.device -> launch keywords: the switches are read once a process


def pdl_args(device) -> dict:
    """Launch keywords for a kernel that starts with `wait_for_producers(PDL)`:
    {"PDL": True, "launch_pdl": True} where PDL is on for `device`, else {}. Decided once
    per device and process (a launch pays one dict lookup); `reset()` after changing
    MINIVLLM_PDL or the GPU profile in a running process."""
    args = _DECIDED.get(device)
    if args is None:
        args = _DECIDED[device] = _ON if _enabled(getattr(device, "type", str(device)),
                                                  getattr(device, "index", None)) else {}
    return args


_EARLY: dict = {}  # torch.device -> how many of a GEMV's first trips are loaded before the wait


def early_weights(device) -> int:
    """How many of a GEMV's first K trips have their quantized bits (words, and the
    high-bit plane of Q6_K and Q5_0 since the session after h100-s58) loaded into
    registers before its wait (1 by default, 2 opt-in), 0 where PDL is off; a launch
    passes `early_trips` of it. The weights depend on no earlier kernel, so under PDL
    their first DRAM round trip can overlap the producer's tail (a small GEMV's time is
    mostly that latency: 3584 x 3584 Q4_K takes 6.7 us for 2.4 us of bytes). Unlike
    the L2 prefetch of the whole slice tried until h100-s56 (slower: 313.9 against 344.4
    tok/s, 7B), this moves loads the kernel makes anyway and adds no instructions. On by
    default where PDL is on (without PDL no kernel starts before its predecessor ends) since
    the h100-s57 call: 7B decode 346.0 against 337.3 tok/s after 512 tokens, 328.3 against
    318.7 after 4,096, 0.5B 1,240.5 against 1,171.8 (same call, same files);
    MINIVLLM_GEMV_EARLY_LOAD=0 turns it off. Decided once per device and process, like
    `pdl_args`."""
    on = _EARLY.get(device)
    if on is None:
        on = _EARLY[device] = early_trips_requested() if pdl_args(device) else 0
    return on


MAX_EARLY_TRIPS = 2  # registers: each trip held before the wait is a tile of weight words


def early_trips_requested() -> int:
    """MINIVLLM_GEMV_EARLY_LOAD as a trip count: 0 (off), 1 (the default) or 2 (the first two
    trips before the wait: opt-in, it lost 8% of the 7B's decode at h100-s59 for 1% on the 0.5B;
    its 168 registers a thread leave 3 programs an SM instead of 4)."""
    raw = os.environ.get(EARLY_ENV, "1").strip()
    if raw not in {str(i) for i in range(MAX_EARLY_TRIPS + 1)}:
        raise ValueError(f"{EARLY_ENV}={raw!r}: expected a trip count from 0 to {MAX_EARLY_TRIPS} "
                         "(0 turns the early load off)")
    return int(raw)


def early_trips(device, slice_trips: int) -> int:
    """The EARLY a GEMV launch passes: `early_weights`, but never more trips than a K slice
    has (`slice_trips`, its partial last trip counted), so no trip is loaded only to be
    masked away."""
    return min(early_weights(device), slice_trips)


def reset() -> None:
    """Forget the per-device decisions (tests, and A/B runs within one process)."""
    _DECIDED.clear()
    _EARLY.clear()
