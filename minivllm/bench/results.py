"""Provenance and result files shared by every benchmark.

A number without its commit, device, library versions, model hash and settings cannot
be compared with anything, so every result file carries all of them.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import platform
import statistics
import os
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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


def _distribution_version(name: str) -> str:
    """The installed version of a package whose module has no __version__ (gguf)."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "?"


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
        "gguf": getattr(gguf, "__version__", None) or _distribution_version("gguf"),
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


def coefficient_of_variation(samples: Sequence[float]) -> float:
    """Sample std / mean; 0 for fewer than two samples (no spread can be seen yet), inf when
    the mean is 0 but the samples differ."""
    if len(samples) < 2:
        return 0.0
    std, mean = statistics.stdev(samples), statistics.fmean(samples)
    if mean == 0:
        return 0.0 if std == 0 else math.inf
    return std / abs(mean)


@dataclass
class StableRuns:
    """The samples of `runs_until_stable` and why it stopped, for a result file's settings."""
    samples: list
    cvs: list[float]                  # one per watched series, after the last run
    min_runs: int
    max_runs: int
    cv_target: float
    stopped: str                      # "stable" (every CV <= target) or "max_runs" (some CV still above)

    @property
    def runs(self) -> int:
        return len(self.samples)

    @property
    def cv(self) -> float:
        return max(self.cvs)

    def info(self) -> dict:
        return {"runs": self.runs, "min_runs": self.min_runs, "max_runs": self.max_runs, "cv": self.cv,
                "cvs": list(self.cvs), "cv_target": self.cv_target, "stopped": self.stopped}


def runs_until_stable(measure_once: Callable[[], object], min_runs: int = 3, max_runs: int = 10,
                      cv_target: float = 0.05, key: str | Callable[[object], float | Sequence[float]] | None = None,
                      ) -> StableRuns:
    """Call `measure_once` at least `min_runs` times, then again while the coefficient of
    variation of a watched series exceeds `cv_target`, at most `max_runs` times in all: the
    project's rule "at least 3 runs, more while the CV is above 5%".

    What is watched: the sample itself (key=None, a number), `sample[key]` (a string key of a
    dict sample), or `key(sample)` (a callable returning a number, or several numbers: one
    series each, e.g. one per engine of a round; every series must be stable)."""
    if min_runs < 1:
        raise ValueError(f"min_runs must be >= 1, got {min_runs}")
    if max_runs < min_runs:
        raise ValueError(f"max_runs ({max_runs}) must be >= min_runs ({min_runs})")

    def watched(sample) -> list[float]:
        value = sample if key is None else key(sample) if callable(key) else sample[key]
        return [float(v) for v in value] if isinstance(value, Sequence) else [float(value)]

    samples: list = []
    series: list[list[float]] = []
    while True:
        sample = measure_once()
        samples.append(sample)
        values = watched(sample)
        series = series or [[] for _ in values]
        if len(values) != len(series):
            raise ValueError(f"run {len(samples)} gave {len(values)} watched values, earlier runs {len(series)}")
        for s, v in zip(series, values):
            s.append(v)
        cvs = [coefficient_of_variation(s) for s in series]
        stable = max(cvs) <= cv_target
        if len(samples) >= min_runs and (stable or len(samples) >= max_runs):
            return StableRuns(samples, cvs, min_runs, max_runs, cv_target, "stable" if stable else "max_runs")


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
