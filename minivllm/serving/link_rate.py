"""How fast K/V moves between two local workers: measured once at start-up, then
corrected by every split request's handoff (issue 43), as worker_rates.py does for the
workers' prefill and decode rates.

The measurement is the transfer's own path on a buffer the size of a long prompt's K/V
(64 MiB by default): copy into a fresh shared-memory segment (what the exporter does),
copy out of it (what the importer does), unlink. The link's rate is bytes over the two
copies' time together, since a split request pays both; the best of a few repeats, as a
calibration takes the steady state rather than the first touch of fresh pages.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import torch

from minivllm.serving.kv_segment import SEGMENT_PREFIX, new_segment, unlink_segment

DEFAULT_PROBE_BYTES = 64 << 20
ALPHA = 0.2  # weight of each observed handoff in the corrected rate


@dataclass
class LinkRate:
    measured_bytes_per_s: float | None = None
    probe_bytes: int = 0
    write_ms: float | None = None
    read_ms: float | None = None
    observed_bytes_per_s: float | None = None  # EWMA over split requests' handoffs
    observations: int = 0

    @property
    def known(self) -> bool:
        return self.bytes_per_s() is not None

    def bytes_per_s(self) -> float | None:
        return self.observed_bytes_per_s or self.measured_bytes_per_s

    def observe(self, nbytes: int, copy_ms: float) -> None:
        """One handoff's bytes and its two copies' time; small ones say little (page faults,
        fixed costs), so only transfers of a MiB or more correct the rate."""
        if nbytes < (1 << 20) or copy_ms <= 0:
            return
        rate = nbytes / (copy_ms / 1e3)
        prev = self.observed_bytes_per_s or self.measured_bytes_per_s or rate
        self.observed_bytes_per_s = (1 - ALPHA) * prev + ALPHA * rate
        self.observations += 1

    def as_dict(self) -> dict:
        rate = self.bytes_per_s()
        return {"mb_per_s": None if rate is None else rate / 1e6,
                "measured_mb_per_s": None if self.measured_bytes_per_s is None else self.measured_bytes_per_s / 1e6,
                "probe_bytes": self.probe_bytes, "write_ms": self.write_ms, "read_ms": self.read_ms,
                "observed_mb_per_s": None if self.observed_bytes_per_s is None else self.observed_bytes_per_s / 1e6,
                "observations": self.observations}


def measure_shared_memory_link(nbytes: int = DEFAULT_PROBE_BYTES, repeats: int = 3) -> LinkRate:
    """Copy `nbytes` into a shared-memory segment and back out, `repeats` times; the best run."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    best = None
    for _ in range(repeats):
        name = f"{SEGMENT_PREFIX}probe-{uuid.uuid4().hex[:12]}"
        try:
            with new_segment(name, src.nbytes) as buf:
                t0 = time.perf_counter()
                torch.frombuffer(buf, dtype=torch.uint8, count=src.nbytes).copy_(src.view(torch.uint8))
                t1 = time.perf_counter()
                torch.frombuffer(buf, dtype=torch.uint8, count=src.nbytes).clone()
                t2 = time.perf_counter()
        finally:
            unlink_segment(name)
        if best is None or (t2 - t0) < sum(best):
            best = (t1 - t0, t2 - t1)
    write_s, read_s = best
    return LinkRate(src.nbytes / (write_s + read_s), src.nbytes, write_s * 1e3, read_s * 1e3)
