"""`minivllm bench plot`: benchmark result files drawn as PNG figures for benchmarks/README.md.

Each figure draws ONE result file: the newest, by the time stamp in its name, of the
`<results>/<prefix>*.json` files whose rows the figure can draw. Files of the same prefix
that hold other rows (`bench speculative`'s greedy and sampling tables written by separate
runs, `peers-gpu-*` next to `peers-*`) are passed over instead of giving an empty figure.
A figure with no such file is skipped and reported. A footer names the source file, commit
and device, so a picture can be traced back to its numbers as a table can.

matplotlib is optional (the `bench` extra) and is imported only when drawing, so the rest
of minivllm works without it.
"""

from minivllm.bench.plots.figures import FIGURES
from minivllm.bench.plots.render import DEFAULT_OUT, INSTALL_HINT, MatplotlibMissing, plot_all, render, write_index
from minivllm.bench.plots.sources import Drawn, Figure, Skipped, newest_source, stamp_key

__all__ = ["DEFAULT_OUT", "FIGURES", "INSTALL_HINT", "Drawn", "Figure", "MatplotlibMissing", "Skipped", "newest_source",
           "plot_all", "render", "stamp_key", "write_index"]
