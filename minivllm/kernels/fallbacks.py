"""Kernels that could not run on this device, and the slower path taken instead.

A Triton kernel that fails to compile or launch here (an older GPU, another Triton) must
not take the engine down: the layer takes a slower path (dequantize + cuBLAS, or the
unfused kernels) after one warning. But a number timed on that path is not the kernel's
number, so every fallback is recorded here, once per (kernel, key), and benchmarks report
them beside their rows (`bench decode` marks such a row degraded instead of "ok").
"""

from __future__ import annotations

import threading
import warnings

_failed: dict[tuple[str, tuple], str] = {}
_lock = threading.Lock()


def failed(kernel: str, key: tuple) -> bool:
    """Whether `kernel` failed here for `key` (then callers go straight to their fallback)."""
    return (kernel, key) in _failed


def record(kernel: str, key: tuple, device, exc: BaseException, instead: str) -> None:
    """`kernel` could not run for `key` on `device`: remember it and warn once."""
    with _lock:
        if (kernel, key) in _failed:
            return
        _failed[(kernel, key)] = f"{kernel}[{', '.join(map(str, key))}]: {type(exc).__name__}"
    warnings.warn(f"Triton kernel {kernel}[{key[0]}] could not run on {device} ({type(exc).__name__}: "
                  f"{str(exc)[:200]}); {instead}", RuntimeWarning, stacklevel=3)


def fallbacks() -> list[str]:
    """Every kernel that fell back in this process, described, in a stable order."""
    with _lock:
        return sorted(_failed.values())
