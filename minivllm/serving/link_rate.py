"""How fast K/V moves between two local workers: measured once at start-up, then
corrected by every split request's handoff (issue 43), as worker_rates.py does for the
workers' prefill and decode rates.

The measurement is the transfer's own path (serving/kv_landing.py) on a buffer the size
of a long prompt's K/V (64 MiB by default): a pool-like memory file, mapped back through
/proc as the exporter maps the importer's pool, and one copy into it; the importer then
only indexes its pages, so there is no read side (`read_ms` 0). The best of a few repeats,
as a calibration takes the steady state. Split requests that go through a segment instead
(kv_segment.py: no mappable pool, or a late reservation) pay a write and a read, and their
observed rates pull the link's down accordingly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

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
    """Copy `nbytes` into a mapped pool-like memory file, `repeats` times; the best run."""
    from minivllm.cache.shared_pool_memory import SharedPoolMemory, attach, detach

    src = torch.ones(nbytes // 8, dtype=torch.float32)
    pool = SharedPoolMemory(tuple(src.shape), torch.float32)  # k and v halves: nbytes in all
    desc = pool.describe()
    try:
        k, v = attach(desc)
        best = None
        for _ in range(repeats):
            t0 = time.perf_counter()
            k.copy_(src)
            v.copy_(src)
            best = min(best or float("inf"), time.perf_counter() - t0)
        del k, v
    finally:
        detach(desc)
        pool.close()
    return LinkRate(2 * src.nbytes / best, 2 * src.nbytes, best * 1e3, 0.0)
