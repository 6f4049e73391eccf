"""The KV page map as a plotly heatmap: the static fallback's map (`show_static()`, nbconvert,
Kaggle commits), so a saved notebook's map is drawn by plotly.js, with the live map's hover.

The same layout (`page_grid.grid_layout`: row-major pages, fixed columns) and colours
(`page_grid.shade`, per page code) as the live canvas. Each cell's hover says what the live
map's does: the page, its state, its request holders, its ref count, cached or not, and the
requests whose block tables hold it.
"""

from __future__ import annotations

import plotly.graph_objects as go

from minivllm_widgets.page_grid import SHARED2, STATES, grid_layout, shade


def hover_words(page: int, code: int, owners: list[str]) -> str:
    """The words the live map's hover shows (page_map_widget's script builds the same)."""
    holders = code - 2 if code >= SHARED2 else (1 if code in (1, 3) else 0)
    cached = code >= 2  # the prefix index holds one reference to every cached page
    words = (f"page {page}: {STATES[min(code, SHARED2)]}, {holders} request holder(s), "
             f"ref count {holders + cached}, {'in the prefix cache' if cached else 'not cached'}")
    return words + (f"; requests: {', '.join(owners)}" if owners else "")


def page_map_figure(codes: bytes, owners: dict[int, list[str]] | None = None) -> go.Figure:
    """One heatmap cell per page, coloured by its code, hover as the live map's."""
    owners = owners or {}
    _, columns, rows = grid_layout(len(codes))
    top = max(codes, default=0)
    z, text = [], []
    for r in range(rows):
        cells = range(r * columns, min(len(codes), (r + 1) * columns))
        z.append([codes[i] for i in cells] + [None] * (columns - len(cells)))  # the last row's tail: no page
        text.append([hover_words(i, codes[i], owners.get(i, [])) for i in cells] + [""] * (columns - len(cells)))
    # one flat band of the colour scale per code 0..top: the cells keep the canvas's colours
    scale = []
    for code in range(top + 1):
        colour = "rgb({},{},{})".format(*shade(code))
        scale += [[code / (top + 1), colour], [(code + 1) / (top + 1), colour]]
    cell_px = max(4, 600 // columns)
    fig = go.Figure(go.Heatmap(z=z, text=text, hovertemplate="%{text}<extra></extra>", colorscale=scale,
                               zmin=-0.5, zmax=top + 0.5, showscale=False, xgap=1, ygap=1))
    fig.update_layout(height=40 + rows * cell_px, width=40 + columns * cell_px, margin={"l": 20, "r": 20, "t": 20,
                                                                                       "b": 20},
                      xaxis={"visible": False}, yaxis={"visible": False, "autorange": "reversed", "scaleanchor": "x"},
                      template="plotly_white", plot_bgcolor="white")
    return fig
