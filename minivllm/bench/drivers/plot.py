"""`minivllm bench plot`."""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.bench import common
from minivllm.bench.driver import Driver


@dataclass
class Settings:
    results: str | None
    out: str | None


def add_arguments(p) -> None:
    p.add_argument("--results", default=None, help="result directory to read (default benchmarks/results)")
    common.add_out(p, "figure directory to write (default benchmarks/plots)")


def run(s: Settings) -> int:
    import sys

    from minivllm.bench.plots import DEFAULT_OUT, MatplotlibMissing, plot_all
    from minivllm.bench.results import RESULTS_DIR

    try:
        plot_all(s.results or RESULTS_DIR, s.out or DEFAULT_OUT)
    except MatplotlibMissing as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


DRIVER = Driver("plot", "draw the newest result file of each benchmark as a PNG figure (benchmarks/plots/*.png and "
                "index.md; needs matplotlib: pip install 'minivllm[bench]')", add_arguments, Settings, run)
