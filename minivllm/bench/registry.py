"""Every benchmark driver, in one list: `minivllm bench <name>` (cli/bench_cmd.py), `minivllm smoke`
and `minivllm bench all` (suite.py) all read it.

Adding a driver: write minivllm/bench/drivers/<name>.py with a `Settings` dataclass (fields
named as the parsed arguments' dests), `add_arguments(parser)` (common flags from
bench/common.py, no torch at import), `run(settings) -> exit code` (importing the measuring
module inside) and `DRIVER = Driver(...)`; add it to DRIVERS below and give it a row in
suite.SUITE (tests/integration/bench/test_bench_all.py fails until it has one).
"""

from __future__ import annotations

import argparse

from minivllm.bench.driver import Driver
from minivllm.bench.drivers import (
    activation_dtype,
    admission,
    continuous_batching,
    decode,
    disaggregation,
    gemv_threshold,
    gguf_open,
    kernels,
    offline,
    peers,
    plot,
    prefix_cache,
    routing,
    scheduling,
    serve,
    smoke,
    speculative,
    stop_strings,
    structured,
)
from minivllm.reliability import driver as soak

# The order of `minivllm bench --help`.
DRIVERS: tuple[Driver, ...] = (
    gguf_open.DRIVER,
    decode.DRIVER,
    activation_dtype.DRIVER,
    gemv_threshold.DRIVER,
    kernels.DRIVER,
    continuous_batching.DRIVER,
    prefix_cache.DRIVER,
    speculative.DRIVER,
    routing.DRIVER,
    disaggregation.DRIVER,
    soak.DRIVER,
    serve.DRIVER,
    scheduling.DRIVER,
    admission.DRIVER,
    stop_strings.DRIVER,
    structured.DRIVER,
    offline.DRIVER,
    peers.DRIVER,
    plot.DRIVER,
    smoke.DRIVER,
)


def bench_drivers() -> tuple[Driver, ...]:
    """The drivers under `minivllm bench`."""
    return tuple(d for d in DRIVERS if d.argv[0] == "bench")


def find(argv: tuple[str, ...]) -> Driver | None:
    """The driver that `python -m minivllm <argv>` reaches, or None."""
    return next((d for d in DRIVERS if d.argv == tuple(argv)), None)


def command_parser(argv: tuple[str, ...]) -> argparse.ArgumentParser | None:
    """A parser of that driver's arguments alone (what `bench all` checks its plan against), or None."""
    driver = find(argv)
    if driver is None:
        return None
    parser = argparse.ArgumentParser(prog="minivllm " + " ".join(driver.argv))
    driver.add_arguments(parser)
    return parser
