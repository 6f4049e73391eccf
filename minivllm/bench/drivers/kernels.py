"""`minivllm bench kernels`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from minivllm.bench import common
from minivllm.bench.driver import Driver


@dataclass
class Settings:
    types: list[str] | None
    shapes: list[tuple[int, int]] | None
    inference_device: str
    batch_rows: int
    row: bool
    early: list[int]


def _shapes(v: str) -> list[tuple[int, int]]:
    try:
        return [tuple(int(d) for d in s.lower().split("x")) for s in v.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of NxK such as 3584x3584, got {v!r}") from None


def add_arguments(p) -> None:
    p.add_argument("--types", type=lambda v: [x.upper() for x in common.names(v)], default=None,
                   help="comma list of weight types (default: all with a GEMV kernel)")
    p.add_argument("--shapes", type=_shapes, default=None, help="comma list of NxK (default: Qwen2.5-7B's four)")
    common.add_inference_device(p, default="gpu", help="gpu or cuda:N")
    p.add_argument("--batch-rows", type=int, default=8, help="M of the multi-row measurement (default 8)")
    p.add_argument("--row", action="store_true",
                   help="issue 41's GEMV row only: each 7B role's GEMV as a decode step launches it, against the "
                        "copy bandwidth and a read-only kernel of the same bytes (bench/gemv_row.py; about a minute)")
    p.add_argument("--early", type=common.int_list, default=[1],
                   help="with --row: comma list of weight trips loaded before the PDL wait (0-2; default 1, the "
                        "engine's default), each timed in the same run")


def run(s: Settings) -> int:
    if s.row:
        refused = _row_refusal(s)
        if refused:
            print(f"minivllm bench kernels --row: {refused}")
            return 2
    import torch

    from minivllm.devices import resolve_device

    if not torch.cuda.is_available():
        print("minivllm bench kernels: needs a CUDA device (it times the Triton GEMV kernels); torch sees none here.")
        return 2
    device = str(resolve_device(s.inference_device))
    if s.row:
        from minivllm.bench.gemv_row import run as run_row

        run_row(s.types, s.early, device=device)
        return 0
    from minivllm.bench.kernels import run as run_all

    run_all(s.types, s.shapes, device=device, batch_rows=s.batch_rows)
    return 0


def _row_refusal(s: Settings) -> str | None:
    """Why --row cannot take these settings, or None."""
    from minivllm.kernels.triton.pdl import MAX_EARLY_TRIPS

    if s.shapes:
        return "the shapes are the 7B's four roles (bench/gemv_row.ROLES); leave out --shapes."
    bad = [e for e in s.early if not 0 <= e <= MAX_EARLY_TRIPS]
    if bad or not s.early:
        return (f"--early {','.join(map(str, s.early))}: weight trips loaded before the PDL wait run from 0 to "
                f"{MAX_EARLY_TRIPS}, for example --early 0,1,2.")
    return None


DRIVER = Driver("kernels", "Triton dequantize-GEMV GB/s per weight type on 7B shapes vs copy bandwidth (CUDA)",
                add_arguments, Settings, run)
