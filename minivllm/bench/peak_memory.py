"""Peak memory of this process, phase by phase (imports, model load, generation).

CPU: the resident set's high-water mark, VmHWM in /proc/self/status. Writing "5" to
/proc/self/clear_refs resets it to the current RSS (Linux >= 4.0), so each phase's peak is
its own. Where /proc is missing, getrusage's ru_maxrss is the only peak there is: the
process's lifetime peak, which cannot be reset, so each phase then reports the peak so far.

CUDA: the caching allocator's counters (torch.cuda.max_memory_allocated and
max_memory_reserved, reset with reset_peak_stats); memory_allocated at the end of a phase
is what stays resident (weights, KV pool). The CUDA context itself (a few hundred MiB)
is not allocator memory and is in none of them.

Every number is measured in the process that does the work, so a benchmark that wants one
peak per case runs each case in a fresh process.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch

MIB = 1 << 20
PROC_STATUS = Path("/proc/self/status")
PROC_CLEAR_REFS = Path("/proc/self/clear_refs")
RESET_HIGH_WATER_MARK = "5"  # clear_refs value that resets VmHWM (Documentation/filesystems/proc.rst)


def _proc_status_kib(field: str) -> int | None:
    try:
        for line in PROC_STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])  # "VmHWM:   123456 kB"
    except OSError:
        return None
    return None


def _ru_maxrss_bytes() -> int:
    # Linux reports kilobytes, macOS bytes.
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


class PeakMemory:
    """`phase()` reports the peak since the last `reset()` (or since the process started);
    `method` says how, for the result row (read it after the first reset: a refused reset
    changes it)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.resets_per_phase = True  # until a reset is refused
        if self.device.type == "cuda":
            self.method = ("torch.cuda.max_memory_allocated / max_memory_reserved, reset per phase "
                           "(CUDA context excluded)")
        elif _proc_status_kib("VmHWM") is None:
            self.resets_per_phase = False
            self.method = "getrusage ru_maxrss (no /proc): the process's peak so far, not reset per phase"
        else:
            self.method = "VmHWM of /proc/self/status, reset per phase by writing 5 to /proc/self/clear_refs"

    def _reset_high_water_mark(self) -> bool:
        """Reset VmHWM; True when the kernel did (VmHWM fell to the current RSS)."""
        try:
            PROC_CLEAR_REFS.write_text(RESET_HIGH_WATER_MARK)
        except OSError:
            return False
        hwm, rss = _proc_status_kib("VmHWM"), _proc_status_kib("VmRSS")
        return hwm is not None and rss is not None and hwm <= rss

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.resets_per_phase and not self._reset_high_water_mark():
            self.resets_per_phase = False
            self.method = "VmHWM of /proc/self/status (clear_refs refused the reset): the process's peak so far"

    def phase(self) -> dict:
        """{"peak_mib", "resident_mib"} (+ the reserved pool's on CUDA) of the phase that just ended."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return {"peak_mib": torch.cuda.max_memory_allocated(self.device) / MIB,
                    "resident_mib": torch.cuda.memory_allocated(self.device) / MIB,
                    "reserved_peak_mib": torch.cuda.max_memory_reserved(self.device) / MIB,
                    "reserved_mib": torch.cuda.memory_reserved(self.device) / MIB}
        hwm, rss = _proc_status_kib("VmHWM"), _proc_status_kib("VmRSS")
        if hwm is None:
            return {"peak_mib": _ru_maxrss_bytes() / MIB, "resident_mib": None}
        return {"peak_mib": hwm / 1024, "resident_mib": rss / 1024 if rss is not None else None}
