"""Bitmask rows sent to the GPU while the forward still runs.

A copy queued on the compute stream waits for the forward queued before it: about 50 us of
transfer after the forward for 11 rows of Qwen2.5's 152k vocabulary, every step, on the
H200 (scripts/structured_step_timeline.py). Here the rows go through a pinned buffer on a
side stream, so the transfer overlaps the forward, and the compute stream waits for it
only before the masking kernel that reads it.

Both buffers are reused step after step. The side stream waits, before it overwrites the
device buffer, for the kernel that last read it; the host waits, before it overwrites the
pinned buffer, for the copy that last read that. Neither wait reaches the forward: both
things were queued before it.
"""

from __future__ import annotations

import numpy as np
import torch


class MaskUpload:
    def __init__(self, device: torch.device):
        self.device = device
        self._pinned: torch.Tensor | None = None
        self._on_device: torch.Tensor | None = None
        self._stream = torch.cuda.Stream(device)
        self._copied = torch.cuda.Event()  # the side stream's copy out of the pinned buffer
        self._read = torch.cuda.Event()  # the compute stream's last use of the device buffer

    def send(self, rows: list[torch.Tensor]) -> torch.Tensor:
        """The bitmask rows (numpy-backed int32 tensors) stacked on the device, ordered
        before whatever the compute stream queues next. Call `done_reading` once the kernel
        reading them is queued."""
        n, words = len(rows), rows[0].numel()
        self._copied.synchronize()
        if self._pinned is None or self._pinned.shape[0] < n or self._pinned.shape[1] != words:
            torch.cuda.current_stream(self.device).synchronize()  # a fresh block may be in use by queued work
            self._pinned = torch.empty((max(n, 16), words), dtype=torch.int32, pin_memory=True)
            self._on_device = torch.empty((max(n, 16), words), dtype=torch.int32, device=self.device)
            self._read.record(torch.cuda.current_stream(self.device))
        host, target = self._pinned[:n], self._on_device[:n]
        np.stack([r.numpy() for r in rows], out=host.numpy())
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(self._read)
            target.copy_(host, non_blocking=True)
            self._copied.record(self._stream)
        torch.cuda.current_stream(self.device).wait_event(self._copied)
        return target

    def done_reading(self) -> None:
        self._read.record(torch.cuda.current_stream(self.device))
