"""`minivllm smoke`: one request per worker, all at once (minivllm/bench/drivers/smoke.py)."""

from __future__ import annotations


def add_smoke_parser(subparsers) -> None:
    from minivllm.bench.registry import find

    find(("smoke",)).add_to(subparsers)
