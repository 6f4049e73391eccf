"""`minivllm bench ...`: one sub-command per registered benchmark driver (minivllm/bench/registry.py),
plus `bench all`, which runs them all. Each writes benchmarks/results/*.json + .md."""

from __future__ import annotations


def add_bench_parser(subparsers) -> None:
    from minivllm.bench.registry import bench_drivers
    from minivllm.bench.suite.cli import DRIVER as ALL

    p = subparsers.add_parser("bench", help="run a benchmark and write results to benchmarks/results/")
    sub = p.add_subparsers(dest="bench", required=True)
    for driver in (ALL, *bench_drivers()):
        driver.add_to(sub)
