"""Result files shared by every benchmark: benchmarks/results/<name>-<stamp>.json and .md.

The provenance that every file carries comes from `minivllm.bench.common.provenance`.
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path

RESULTS_DIR = Path("benchmarks/results")


def write_results(name: str, meta: dict, rows: list[dict], columns: list[str], notes: str = "") -> tuple[Path, Path]:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    # Not Path.with_suffix: model names such as "qwen2.5-coder-0.5b" contain dots.
    json_path, md_path = RESULTS_DIR / f"{name}-{stamp}.json", RESULTS_DIR / f"{name}-{stamp}.md"
    json_path.write_text(json.dumps({"benchmark": name, "provenance": meta, "rows": rows}, indent=2))
    lines = [f"# {name}", "", notes, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |")
    lines += ["", "Provenance:", "", "```json", json.dumps(meta, indent=2), "```", ""]
    md_path.write_text("\n".join(lines))
    return json_path, md_path


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)
