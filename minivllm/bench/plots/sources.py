"""Picking each figure's source (the newest result file holding its rows) and reading rows from it."""

from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# A result file's stamp: 20261201T061354Z from results.write_results, or a bare date.
_STAMP = re.compile(r"(\d{8})(?:T(\d{6})Z)?")


@dataclass(frozen=True)
class Figure:
    name: str                                   # the PNG is <out>/<name>.png
    prefix: str                                 # source candidates: <results>/<prefix>*.json
    title: str
    shows: str                                  # one line for index.md
    wants: Callable[[dict], bool]               # does this result file hold rows the figure draws
    draw: Callable[[object, dict], str | None]  # (matplotlib Figure, result data) -> a note for the footer


@dataclass(frozen=True)
class Drawn:
    figure: Figure
    png: Path
    source: Path


@dataclass(frozen=True)
class Skipped:
    figure: Figure
    reason: str


def stamp_key(path: Path) -> tuple[str, str]:
    """Sortable (date, time) of a result file's name; the last stamp in the name counts
    (bench serve appends -2, -3 after it). Names without one sort first."""
    found = _STAMP.findall(path.stem)
    if not found:
        return ("", "")
    date, time = found[-1]
    return (date, time or "000000")


def _load(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _extent(data: dict) -> int:
    return len(data.get("rows") or data.get("targets") or [])


def newest_source(results_dir: Path, figure: Figure) -> tuple[Path, dict] | None:
    """The newest result file for `figure`, with its data. On equal stamps (one `bench serve`
    run writes a per-server file and a comparison) the file with more rows or servers wins."""
    candidates = []
    for path in sorted(results_dir.glob(f"{figure.prefix}*.json")):
        data = _load(path)
        if data is not None and figure.wants(data):
            candidates.append((stamp_key(path), _extent(data), path.name, path, data))
    if not candidates:
        return None
    *_, path, data = max(candidates, key=lambda c: c[:3])
    return path, data


def rows_of(data: dict, **match) -> list[dict]:
    return [r for r in data.get("rows") or [] if all(r.get(k) == v for k, v in match.items())]


def rows_with(data: dict, *keys: str) -> list[dict]:
    return [r for r in data.get("rows") or [] if all(isinstance(r.get(k), (int, float)) for k in keys)]


def to_number(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def ordered(values) -> list:
    """Distinct values in order of first appearance (the driver's own order)."""
    return list(dict.fromkeys(values))


def mean_std(row: dict, key: str, scale: float = 1.0) -> tuple[float | None, float | None]:
    mean, std = to_number(row.get(f"{key}_mean")), to_number(row.get(f"{key}_std"))
    return (None if mean is None else mean * scale, None if std is None else std * scale)


def to_ms(seconds) -> float | None:
    v = to_number(seconds)
    return None if v is None else v * 1000.0


def source_footer(source: Path, data: dict) -> str:
    prov = data.get("provenance") or {}
    text = (f"source: {source.name} · commit {prov.get('commit', '?')} · device {prov.get('device', '?')}"
            f" · {prov.get('date', '?')}")
    return "\n".join(textwrap.wrap(text, 150))
