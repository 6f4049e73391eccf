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


def run(s: Settings) -> int:
    import torch

    from minivllm.bench.kernels import run
    from minivllm.devices import resolve_device

    if not torch.cuda.is_available():
        print("minivllm bench kernels: needs a CUDA device (it times the Triton GEMV kernels); torch sees none here.")
        return 2
    run(s.types, s.shapes, device=str(resolve_device(s.inference_device)), batch_rows=s.batch_rows)
    return 0


DRIVER = Driver("kernels", "Triton dequantize-GEMV GB/s per weight type on 7B shapes vs copy bandwidth (CUDA)",
                add_arguments, Settings, run)
