"""Drawing the figures to PNG with matplotlib's Agg canvas (imported only here, when drawing) and
writing benchmarks/plots/index.md."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from minivllm.bench.plots.figures import FIGURES
from minivllm.bench.plots.sources import Drawn, Figure, Skipped, newest_source, source_footer

DEFAULT_OUT = Path("benchmarks/plots")


INSTALL_HINT = "pip install 'minivllm[bench]'"


DPI = 100


FIGSIZE = (8.0, 4.5)  # inches: 800x450 px at DPI, small enough for PNGs well under 100 KB


class MatplotlibMissing(RuntimeError):
    pass


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure as MplFigure
    except ImportError as exc:
        raise MatplotlibMissing(
            f"minivllm bench plot needs matplotlib, which is not installed: {INSTALL_HINT}"
        ) from exc
    return MplFigure, FigureCanvasAgg


def render(figure: Figure, source: Path, data: dict, png: Path) -> None:
    MplFigure, FigureCanvasAgg = _matplotlib()
    # A bare Figure on the Agg canvas, not pyplot: no global backend switch and no figure
    # registry in the caller's process (a notebook keeps its own backend).
    fig = MplFigure(figsize=FIGSIZE, dpi=DPI)
    FigureCanvasAgg(fig)
    note = figure.draw(fig, data)
    fig.suptitle(f"{figure.title}\n{data.get('benchmark', '')}", fontsize=10)
    footer = "\n".join(filter(None, [note, source_footer(source, data)]))
    fig.text(0.01, 0.01, footer, fontsize=6.5, color="0.35", ha="left", va="bottom")
    bottom = 0.04 + 0.025 * footer.count("\n")
    fig.tight_layout(rect=(0, bottom, 1, 1))
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=DPI)


def plot_all(results_dir: Path, out_dir: Path, figures: tuple[Figure, ...] = FIGURES,
             progress: Callable[[str], None] | None = print) -> tuple[list[Drawn], list[Skipped]]:
    """Draw every figure whose source exists; write <out>/index.md. Raises MatplotlibMissing
    before touching anything when matplotlib is not installed."""
    _matplotlib()
    say = progress or (lambda line: None)
    results_dir, out_dir = Path(results_dir), Path(out_dir)
    drawn: list[Drawn] = []
    skipped: list[Skipped] = []
    for figure in figures:
        found = newest_source(results_dir, figure)
        if found is None:
            reason = f"no {figure.prefix}*.json with rows it can draw in {results_dir}"
            skipped.append(Skipped(figure, reason))
            say(f"bench plot: skipped {figure.name}: {reason}")
            continue
        source, data = found
        png = out_dir / f"{figure.name}.png"
        render(figure, source, data, png)
        drawn.append(Drawn(figure, png, source))
        say(f"bench plot: wrote {png} (from {source.name})")
    index = write_index(out_dir, drawn, skipped)
    say(f"bench plot: {len(drawn)} figures, {len(skipped)} skipped; index {index}")
    return drawn, skipped


def write_index(out_dir: Path, drawn: list[Drawn], skipped: list[Skipped]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = ["# Benchmark plots", "",
             "Written by `minivllm bench plot` (also the last step of `minivllm bench all`): each figure draws the "
             "newest result file, by the time stamp in its name, that holds its rows. Its footer names that file, "
             "the commit and the device.", "",
             "| figure | shows | source |", "|---|---|---|"]
    for d in drawn:
        link = Path(os.path.relpath(d.source, out_dir)).as_posix()
        lines.append(f"| [{d.figure.name}]({d.png.name}) | {d.figure.shows} | [{d.source.name}]({link}) |")
    if skipped:
        lines += ["", "Skipped (no result file with rows they draw yet):", ""]
        lines += [f"- {s.figure.name}: {s.reason}" for s in skipped]
    path = out_dir / "index.md"
    path.write_text("\n".join(lines) + "\n")
    return path
