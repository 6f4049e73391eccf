"""Helpers every benchmark driver shares: provenance, the CV rule, summary statistics, the load
average, and the command-line flags with one spelling across drivers.

No torch at import time: the command line imports this module to declare its flags, and the
HTTP load clients use its statistics; the functions that need torch import it themselves.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import os
import platform
import statistics
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from minivllm.errors import ConfigError

CV_TARGET = 0.05  # the project's rule: more runs while a watched series varies more than this


# ---------------------------------------------------------------------------- provenance
# A number without its commit, device, library versions, model hash and settings cannot be
# compared with anything, so every result file carries all of them.

def git_commit() -> str:
    # A copy of the tree run elsewhere (the GPU box) may carry a stale .git: the caller
    # then passes the real commit in MINIVLLM_COMMIT.
    if os.environ.get("MINIVLLM_COMMIT"):
        return os.environ["MINIVLLM_COMMIT"]
    # The checkout the measured code came from, wherever the bench was started.
    here = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True, cwd=here
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=here
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name(device: str) -> str:
    import torch

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
    import torch

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


def model_label(model: str) -> str:
    """A file-name-safe name: a registry name as is, a .gguf path as its stem."""
    return Path(model).stem if model.endswith(".gguf") or "/" in model else model


def loadavg() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the OS has none): a busy machine explains noisy runs."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# ---------------------------------------------------------------------------- the CV rule

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


def default_max_repeats(repeats: int, max_repeats: int | None) -> int:
    """`max_repeats`, 3 x `repeats` when None; refused below `repeats`."""
    max_repeats = 3 * repeats if max_repeats is None else max_repeats
    if max_repeats < repeats:
        raise ConfigError("max_repeats", max_repeats, f"must be >= repeats ({repeats})")
    return max_repeats


def record_rounds(row: dict, rounds: StableRuns, watched: list[str]) -> None:
    """A row's number of runs, the CV of each watched series (`<name>_cv`), their max and why it stopped."""
    row["runs"] = rounds.runs
    for name, cv in zip(watched, rounds.cvs, strict=True):
        row[f"{name}_cv"] = cv
    row["cv"], row["stopped"] = rounds.cv, rounds.stopped


def runs_note(all_rounds: list[StableRuns], repeats: int, max_repeats: int, what: str) -> str:
    """'mean ± sample std over R runs (at least N, more while the CV of a <what> exceeded 5%, ...)', for a note."""
    runs = sorted({r.runs for r in all_rounds})
    count = f"{runs[0]}" if len(runs) == 1 else f"{runs[0]}-{runs[-1]} (column runs)"
    at_max = sum(r.stopped == "max_runs" for r in all_rounds)
    stopped = ("stable" if not at_max else "max_runs" if at_max == len(all_rounds)
               else f"{at_max} of {len(all_rounds)} rows at max_runs, the others stable")
    return (f"mean ± sample std over {count} runs (at least {repeats}, more while the CV of a {what} exceeded "
            f"{CV_TARGET:.0%}, at most {max_repeats}; stopped: {stopped}; column cv: a row's largest such CV)")


# ---------------------------------------------------------------------------- summary statistics

def summarize(samples: list[float]) -> dict:
    return {
        "n": len(samples),
        "median": statistics.median(samples),
        "mean": statistics.fmean(samples),
        "std": statistics.stdev(samples) if len(samples) > 1 else 0.0,
        "min": min(samples),
        "max": max(samples),
    }


def record_stat(row: dict, key: str, samples: list[float], column: str | bool = True) -> None:
    """`<key>_mean`, `_std`, `_median` of `samples` into `row`, and "mean ± std" as the Markdown column
    (`key` itself, the name given, or none for column=False)."""
    s = summarize(samples)
    row[f"{key}_mean"], row[f"{key}_std"], row[f"{key}_median"] = s["mean"], s["std"], s["median"]
    if column is not False:
        row[key if column is True else column] = f"{s['mean']:.4g} ± {s['std']:.2g}"


def percentile(values, q: float, empty=None):
    """The q-th percentile by linear interpolation between closest ranks (numpy.percentile's
    default), so reports match what a reader computes with numpy; `empty` for no values."""
    s = sorted(values)
    if not s:
        return empty
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two outputs share (where two engines' greedy outputs part)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---------------------------------------------------------------------------- common flags
# One spelling per concept across every driver (and as `generate`/`serve` spell them):
# --model, --inference-device, --activation-dtype, --runs/--max-runs, --prompt-tokens,
# --max-tokens (the output length), --option KEY=VALUE, --out.

def add_model(p: argparse.ArgumentParser, default: str | None = "smollm2-135m", help: str | None = None,
              repeatable: bool = False) -> None:
    p.add_argument("--model", action="append" if repeatable else "store", default=default,
                   help=help or "model name or .gguf path")


def add_inference_device(p: argparse.ArgumentParser, default: str | None = "cpu", help: str = "cpu, gpu, cuda:N",
                         repeatable: bool = False) -> None:
    p.add_argument("--inference-device", action="append" if repeatable else "store", default=default, help=help)


def add_activation_dtype(p: argparse.ArgumentParser, default: str | None = "f32", help: str = "f32, f16, bf16",
                         repeatable: bool = False, choices=None) -> None:
    p.add_argument("--activation-dtype", action="append" if repeatable else "store", default=default, help=help,
                   choices=choices)


def add_runs(p: argparse.ArgumentParser, default: int | None = 3, help: str | None = None,
             max_default: int | None = None, max_help: str | None = None) -> None:
    """--runs (at least this many timed runs) and --max-runs (the CV rule's ceiling)."""
    p.add_argument("--runs", type=int, default=default, help=help)
    p.add_argument("--max-runs", type=int, default=max_default,
                   help=max_help or f"more runs while a watched CV exceeds {CV_TARGET:.0%}, up to this "
                                    "(default 3 x --runs)".replace("%", "%%"))


def add_max_tokens(p: argparse.ArgumentParser, default: int | None, help: str) -> None:
    p.add_argument("--max-tokens", type=int, default=default, help=help)


def add_prompt_tokens(p: argparse.ArgumentParser, default: int | None, help: str) -> None:
    p.add_argument("--prompt-tokens", type=int, default=default, help=help)


def add_synthetic(p: argparse.ArgumentParser, choices=("qwen2.5-7b-q4_k_m", "qwen2.5-0.5b-q4_k_m")) -> None:
    """--synthetic (a random-weight model of a real layout instead of --model) and the
    file its tokenizer is copied from (bench/synthetic_model.py)."""
    p.add_argument("--synthetic", default=None, choices=list(choices),
                   help="measure a synthetic model with this layout (random weights; written to the cache once)")
    p.add_argument("--synthetic-tokenizer", default=None,
                   help="Qwen2.5 GGUF (or tokenizer-fields .json.xz) to copy the synthetic model's tokenizer from "
                        "(default: qwen2.5-coder-0.5b)")


def add_option(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help=help)


def add_out(p: argparse.ArgumentParser, help: str = "result directory (default benchmarks/results)") -> None:
    p.add_argument("--out", default=None, help=help)


def engine_options(items: list[str]) -> dict:
    """--option KEY=VALUE items as engine options, checked and parsed by the engine's own rule."""
    from minivllm.engine.options import parse_overrides

    return parse_overrides(items, "option")


def int_list(v: str) -> list[int]:
    try:
        return [int(x) for x in v.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {v!r}") from None


def names(v: str) -> list[str]:
    """A comma list, blanks dropped."""
    return [x.strip() for x in v.split(",") if x.strip()]


def range_type(sep: str, cast, minimum):
    """An argparse type for "LO<sep>HI" with minimum <= LO <= HI (burst sizes, gaps, lengths)."""
    kind = "integers" if cast is int else "numbers"

    def parse(v: str):
        try:
            lo, hi = (cast(x) for x in v.split(sep))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected MIN{sep}MAX {kind}, got {v!r}") from None
        if not minimum <= lo <= hi:
            raise argparse.ArgumentTypeError(f"expected {minimum} <= MIN <= MAX, got {v!r}")
        return lo, hi
    return parse
