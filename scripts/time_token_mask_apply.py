"""Host time of applying token masks to logits rows: the Triton kernel against the torch
unpack, as `constraint.mask_in_place` would run them at a decode step (rows stacked
fresh, the bitmask copied to the device), on Qwen2.5's vocabulary width. A decode
step waits for this on the host, so host time per call is what matters. Usage on a GPU:
    python scripts/time_token_mask_apply.py
"""

import time

import torch

from minivllm.kernels.triton.token_mask import mask_rows_inplace
from minivllm.sampling.constraint import allowed_tokens, new_bitmask

VOCAB = 151936
for rows in (1, 4, 16):
    logits = torch.randn(rows, VOCAB, device="cuda")
    bitmask = new_bitmask(rows, VOCAB)
    bitmask.random_()
    ways = {
        "triton": lambda logits=logits, bitmask=bitmask: mask_rows_inplace(
            logits.clone(), bitmask.to("cuda", non_blocking=True)
        ),
        "torch": lambda logits=logits, bitmask=bitmask: logits.clone().masked_fill_(
            ~allowed_tokens(bitmask, VOCAB, logits.device), float("-inf")
        ),
    }
    for name, way in ways.items():
        for _ in range(20):
            way()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        n = 300
        for _ in range(n):
            way()
        host = (time.perf_counter() - t0) / n
        torch.cuda.synchronize()
        total = (time.perf_counter() - t0) / n
        t1 = time.perf_counter()
        for _ in range(n):
            way()
            torch.cuda.synchronize()
        synced = (time.perf_counter() - t1) / n
        print(f"rows {rows:2d} {name:6s}: host {host * 1e6:6.1f} us/call, with the device {total * 1e6:6.1f} us/call, "
              f"synchronized each call {synced * 1e6:6.1f} us")
