"""Provenance and result files shared by every benchmark.

A number without its commit, device, library versions, model hash and settings cannot
be compared with anything, so every result file carries all of them.
"""

from __future__ import annotations

import datetime as _dt
import json
import platform
import statistics
import os
import subprocess
from pathlib import Path

import torch

RESULTS_DIR = Path("benchmarks/results")


def git_commit() -> str:
    # A copy of the tree run elsewhere (the GPU box) may carry a stale .git: the caller
    # then passes the real commit in MINIVLLM_COMMIT.
    if os.environ.get("MINIVLLM_COMMIT"):
        return os.environ["MINIVLLM_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        idx = torch.device(device).index or 0
        major, minor = torch.cuda.get_device_capability(idx)
        return f"{torch.cuda.get_device_name(idx)} (sm_{major}{minor})"
    return f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def provenance(device: str, model_sha256: str | None, settings: dict) -> dict:
    import gguf
    import tokenizers

    return {
        "commit": git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(device),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gguf": getattr(gguf, "__version__", "?"),
        "tokenizers": tokenizers.__version__,
        "model_sha256": model_sha256,
        "settings": settings,
    }


def summarize(samples: list[float]) -> dict:
    return {
        "n": len(samples),
        "median": statistics.median(samples),
        "mean": statistics.fmean(samples),
        "std": statistics.stdev(samples) if len(samples) > 1 else 0.0,
        "min": min(samples),
        "max": max(samples),
    }


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
