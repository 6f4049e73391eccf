"""Reads back the figures in HTML that plotly.io.to_html wrote: each `Plotly.newPlot(id,
data, layout, config)` call's arguments, parsed as strict JSON (NaN and Infinity, which
Python's json accepts by default and plotly.js would draw as nothing or garbage, raise).

The tests of the static charts use this instead of our own reading of our own output: what
counts is what plotly.js will be handed.
"""

from __future__ import annotations

import json
import math
import re

NEW_PLOT = re.compile(r"Plotly\.newPlot\(\s*")


def _reject(name: str):
    raise ValueError(f"a non-finite JSON constant reaches plotly.js: {name}")


_STRICT = json.JSONDecoder(parse_constant=_reject)


def _skip_comma(text: str, i: int) -> int:
    while text[i].isspace():
        i += 1
    assert text[i] == ",", f"expected ',' in a Plotly.newPlot call at {text[i:i + 40]!r}"
    i += 1
    while text[i].isspace():
        i += 1
    return i


def figures(html: str) -> list[dict]:
    """Every figure in `html`: {"id", "data", "layout", "config"}, in order."""
    out = []
    for match in NEW_PLOT.finditer(html):
        i = match.end()
        plot_id, i = _STRICT.raw_decode(html, i)
        i = _skip_comma(html, i)
        data, i = _STRICT.raw_decode(html, i)
        i = _skip_comma(html, i)
        layout, i = _STRICT.raw_decode(html, i)
        i = _skip_comma(html, i)
        config, _ = _STRICT.raw_decode(html, i)
        assert f'id="{plot_id}"' in html, f"Plotly.newPlot targets {plot_id}, a div the HTML does not hold"
        out.append({"id": plot_id, "data": data, "layout": layout, "config": config})
    return out


def finite_points(figure: dict) -> list[float]:
    """The figure's y values that plotly.js draws as points (null is a gap); each must be a
    finite number."""
    values = []
    for trace in figure["data"]:
        for v in trace.get("y", []):
            if v is None:
                continue
            assert isinstance(v, (int, float)) and math.isfinite(v), f"{trace.get('name')}: {v!r}"
            values.append(float(v))
    return values
