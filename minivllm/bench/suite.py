"""`minivllm bench all`: every benchmark of the project, one after another.

SUITE below is the plan: one row per benchmark with its command, its arguments for
`--quick` (small models, few tokens, 1 run: a check that every driver still works and
writes its files) and for the full run (the sizes the published tables use), and how it
takes devices. Each benchmark runs as its own `python -m minivllm ...` subprocess, so a
crash or an out-of-memory in one does not stop the others and each starts a fresh
process and engine. Per benchmark the orchestrator records the command line, exit code,
wall time, the result files that appeared in benchmarks/results/ during it, and the tail
of its output when it failed; then it writes benchmarks/results/bench-all-<devices>-<stamp>.json
and .md and exits 1 if anything failed.

Arguments may hold placeholders, filled in per run:

* ``{dtypes}``: one ``--activation-dtype X`` per activation dtype that every device of the
  run supports (f32, f16; bf16 on CPUs and on GPUs of sm_80 or newer);
* ``{results}``, ``{tag}``, ``{stamp}``: the results directory, the run's device tag and
  the suite's time stamp (for drivers that take an output path, e.g. `smoke --json`);
* ``?--flag``: ``--flag`` only if the subcommand has that option (for drivers added later).

The devices are passed as ``--inference-device D`` (when the subcommand has that option),
according to the row's mode:

* NONE: no device (file format work);
* EACH: one run per device;
* ALL: one run with every device (each becomes a worker or a measured column);
* PAIR: one run with at least two workers: the devices given if there are two or more,
  else [cuda:N, cpu] for one GPU, else two one-thread CPU workers (the drivers' default);
* GPU: one run per CUDA device; skipped when none is given;
* CPU: one run on the first CPU device given; skipped when none is.

Test hook: $MINIVLLM_BENCH_ALL_EXTRA_ARGS, a JSON object name → list of extra arguments,
appends arguments to a benchmark's command (tests inject a bogus one to make it fail).
"""

from __future__ import annotations

import argparse
import collections
import datetime as _dt
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

NONE, EACH, ALL, PAIR, GPU, CPU = "none", "each", "all", "pair", "gpu", "cpu"
EXTRA_ARGS_ENV = "MINIVLLM_BENCH_ALL_EXTRA_ARGS"
TAIL_LINES = 40


@dataclass(frozen=True)
class Bench:
    """One benchmark of the suite. `quick`/`full` are argument tuples, or dicts with a
    "cpu" and a "cuda" tuple (chosen by whether the run has a CUDA device); `quick=None`
    means full-suite only."""
    name: str
    argv: tuple[str, ...]                       # after `python -m minivllm`
    quick: tuple | dict | None
    full: tuple | dict
    devices: str = EACH
    optional: bool = False                      # run only if `argv` is a registered subcommand
    covers: str = ""                            # the article table(s) it reproduces


_SMALL = "smollm2-135m"
_QWEN05 = "qwen2.5-coder-0.5b"

# fmt: off
SUITE: tuple[Bench, ...] = (
    Bench("gguf-open", ("bench", "gguf-open"),
          quick=("--model", _SMALL, "--repeats", "1"),
          full=("--baseline",),
          devices=NONE, covers="load time (no article table)"),
    Bench("decode", ("bench", "decode"),
          quick={"cpu": ("--model", _SMALL, "--activation-dtype", "f32", "--prompt-tokens", "64", "--max-tokens", "16",
                         "--repeats", "1", "--no-baselines"),
                 "cuda": ("--model", _SMALL, "--activation-dtype", "f16", "--prompt-tokens", "64", "--max-tokens", "16",
                          "--repeats", "1")},
          full={"cpu": ("--model", _SMALL, "--activation-dtype", "f32", "--prompt-tokens", "512",
                        "--max-tokens", "128", "--repeats", "3"),
                "cuda": ("--model", _SMALL, "--activation-dtype", "f16", "--prompt-tokens", "512",
                         "--max-tokens", "128", "--repeats", "3")},
          devices=EACH, covers="peer table (measured-peers.md): batch-1 prefill/decode vs llama.cpp, transformers"),
    Bench("decode-qwen0.5b", ("bench", "decode"),
          quick=None,
          full={"cpu": ("--model", _QWEN05, "--activation-dtype", "f32", "--prompt-tokens", "512",
                        "--max-tokens", "128", "--repeats", "3"),
                "cuda": ("--model", _QWEN05, "--activation-dtype", "f16", "--prompt-tokens", "512",
                         "--max-tokens", "128", "--repeats", "3")},
          devices=EACH, covers="peer table: the second model"),
    Bench("decode-7b-synthetic", ("bench", "decode"),
          quick=("--synthetic", "qwen2.5-7b-q4_k_m", "--activation-dtype", "f16", "--prompt-tokens", "64",
                 "--max-tokens", "16", "--repeats", "1"),
          full=("--synthetic", "qwen2.5-7b-q4_k_m", "--activation-dtype", "f16", "--prompt-tokens", "512",
                "--max-tokens", "128", "--repeats", "3"),
          devices=GPU, covers="peer table (GPU): Qwen2.5-7B Q4_K_M decode vs the roofline"),
    # No dtype arguments: the driver runs every dtype the device supports (bf16 from sm_80).
    Bench("activation-dtype", ("bench", "activation-dtype"),
          quick=("--model", _SMALL, "--prompt-tokens", "32", "--max-tokens", "8", "--repeats", "1"),
          full=("--model", _QWEN05, "--prompt-tokens", "512", "--max-tokens", "128", "--repeats", "3"),
          devices=EACH, covers="activation dtype (f32/f16/bf16): TTFT, decode tok/s, peak memory, a process per dtype"),
    Bench("gemv-threshold", ("bench", "gemv-threshold"),
          quick=("--concurrency", "1,2", "--max-tokens", "8", "--repeats", "1"),
          full={"cpu": ("--concurrency", "1,2,3,4,5,8", "--max-tokens", "32", "--repeats", "3", "--batch-invariant"),
                "cuda": ("--activation-dtype", "f16", "--concurrency", "1,2,3,4,5,6,7,8", "--max-tokens", "32",
                         "--repeats", "3", "--batch-invariant")},
          devices=EACH, covers="continuous-batching article: unbatched / GEMM / row-wise GEMV by concurrency"),
    Bench("kernels", ("bench", "kernels"),
          quick=("--types", "Q4_K,Q8_0", "--shapes", "3584x3584"),
          full=(),
          devices=GPU, covers="GEMV GB/s per weight type vs copy bandwidth (no article table)"),
    Bench("continuous-batching", ("bench", "continuous-batching"),
          quick=("--parts", "batching", "--concurrency", "1,2", "--max-tokens", "8", "--repeats", "1"),
          full=("--parts", "batching"),
          devices=EACH, covers="continuous-batching article: 2 requests batched vs sequential"),
    Bench("paged-vs-contiguous", ("bench", "continuous-batching"),
          quick=("--parts", "kv", "--decode-lengths", "32", "--repeats", "1"),
          full={"cpu": ("--parts", "kv", "--decode-lengths", "128,512"),
                "cuda": ("--parts", "kv", "--decode-lengths", "512,2048")},
          devices=EACH, covers="CUDA article: contiguous vs paged KV decode"),
    Bench("scheduling", ("bench", "scheduling"),
          quick=("--repeats", "1", "--long-prompts", "2", "--long-tokens", "64", "--fair-prompts", "2",
                 "--fair-tokens", "64", "--max-tokens", "4", "--max-batched-tokens", "32"),
          full=(),
          devices=EACH, covers="scheduling policies: head-of-line TTFT, fairness"),
    Bench("prefix-cache", ("bench", "prefix-cache"),
          quick=("--repeats", "1", "--output-tokens", "4", "--groups", "2", "--parts", "single-flight"),
          full={"cpu": (),
                "cuda": ("--model", _QWEN05, "--activation-dtype", "f16")},
          devices=EACH, covers="prefix-cache article: warm prefix, cold burst, incremental, single flight"),
    Bench("speculative", ("bench", "speculative"),
          quick=("--model", _SMALL, "--draft-model", _SMALL, "--max-tokens", "16", "--runs", "1", "--seeds", "1",
                 "--prompts", "code", "--cases", "fixed-4", "--sampling-policy", "fixed:4", "--tv-budgets", "0,1"),
          full={"cpu": (),
                "cuda": ("--synthetic-pair", "--activation-dtype", "f16", "--sampling-policy",
                         "fixed:4/fixed:6/fixed:8")},
          devices=EACH, covers="speculative article: greedy policies; TV-budget break-even"),
    Bench("routing", ("bench", "routing"),
          quick=("--quick",),
          full={"cpu": (), "cuda": ("--model", _QWEN05)},
          devices=PAIR, covers="routing article: forced-fastest vs cost, bursts of 8 and 48"),
    Bench("smoke", ("smoke",),
          quick=("--max-tokens", "16", "--json", "{results}/smoke-{tag}-{stamp}.json"),
          full=("--model", _QWEN05, "--max-tokens", "128", "--json", "{results}/smoke-{tag}-{stamp}.json"),
          devices=ALL, covers="CUDA article: smoke table, one request per worker"),
    Bench("soak", ("bench", "soak"),
          quick=("--requests", "40", "--max-new-tokens", "8", "--max-prompt-tokens", "64", "--burst", "5,15",
                 "--gap", "0.1,0.5", "--max-model-len", "512", "--max-rss-growth", "0"),
          full=(),
          devices=PAIR, covers="robustness (no article table)"),
    Bench("serve", ("bench", "serve"),
          quick=("--start-server", "--model", _SMALL, "--num-prompts", "8", "--input-len", "32", "--output-len", "8"),
          full=("--start-server", "--model", _QWEN05, "--num-prompts", "200", "--input-len", "512",
                "--output-len", "128", "--request-rate", "4"),
          devices=ALL, covers="online serving load: TTFT/TPOT/ITL/goodput (no article table)"),
    Bench("offline", ("bench", "offline"),
          quick=("?--quick",),
          full={"cpu": ("--num-seqs", "32", "--input-len-range", "64:256", "--output-len-range", "64:256"),
                # 256 requests in flight at once, as nano-vllm's bench does; f16 (T4 has no bf16).
                "cuda": ("--activation-dtype", "f16", "--option", "max_active_requests=256",
                         "--option", "max_batched_tokens=8192")},
          devices=EACH, optional=True, covers="offline throughput, nano-vllm's workload (no article table)"),
    Bench("peers", ("bench", "peers"),
          quick=("--prompt-len", "32", "--decode-tokens", "8", "--runs", "1"),
          full=("--prompt-len", "512", "--decode-tokens", "128", "--runs", "3"),
          devices=CPU, optional=True, covers="peer table (measured-peers.md): CPU vs transformers and llama.cpp"),
    Bench("peers-gpu", ("bench", "peers"),
          quick=("--batch-sizes", "1,4", "--prompt-len", "32", "--decode-tokens", "8", "--runs", "1"),
          full=("--batch-sizes", "1,8,32,64", "--prompt-len", "128", "--decode-tokens", "128", "--runs", "3"),
          devices=GPU, covers="peers on a GPU: batched generation vs transformers' own generate"),
    # Last, so the figures draw the result files the runs above just wrote.
    Bench("plot", ("bench", "plot"),
          quick=(),
          full=(),
          devices=NONE, covers="benchmarks/plots/*.png: figures of the newest result files"),
)
# fmt: on

# `minivllm bench` subcommands deliberately not in SUITE, with the reason.
EXCLUDED: dict[str, str] = {
    "all": "this orchestrator itself",
}

# Measurements the issue asks for that no driver makes yet (listed in the index).
NOT_IMPLEMENTED: dict[str, str] = {}


def by_name() -> dict[str, Bench]:
    return {b.name: b for b in SUITE}


# ---------------------------------------------------------------------------- the parser

def bench_subparsers(parser: argparse.ArgumentParser | None = None) -> dict[str, argparse.ArgumentParser]:
    """`minivllm bench`'s registered subcommands, name → parser."""
    if parser is None:
        from minivllm.cli.main import build_parser
        parser = build_parser()
    bench = _subparsers(parser)["bench"]
    return _subparsers(bench)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps subcommands only here
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def command_parser(argv: tuple[str, ...], parser: argparse.ArgumentParser | None = None):
    """The sub-parser that `python -m minivllm <argv>` reaches, or None if not registered."""
    if parser is None:
        from minivllm.cli.main import build_parser
        parser = build_parser()
    p = parser
    for word in argv:
        p = _subparsers(p).get(word)
        if p is None:
            return None
    return p


def _options(p: argparse.ArgumentParser) -> set[str]:
    return {s for a in p._actions for s in a.option_strings}


# ---------------------------------------------------------------------------- the plan

@dataclass
class Run:
    """One planned subprocess."""
    name: str
    bench: str
    argv: list[str]                   # full command, starting with the Python executable
    devices: list[str]
    skip_reason: str | None = None
    record: dict = field(default_factory=dict)

    @property
    def cmdline(self) -> str:
        return shlex.join(self.argv)


def is_cuda(device: str) -> bool:
    return device.startswith("cuda") or device.startswith("gpu")


def device_tag(devices: list[str]) -> str:
    return "-".join(d.replace(":", "") for d in devices) or "none"


def supported_dtypes(devices: list[str], capabilities: dict[str, tuple[int, int]] | None) -> list[str]:
    """f32 and f16 everywhere; bf16 on CPUs and on GPUs of sm_80 or newer (minivllm refuses
    it below). A GPU whose capability is unknown is assumed older (no bf16)."""
    dtypes = ["f32", "f16", "bf16"]
    for d in devices:
        if is_cuda(d) and (capabilities or {}).get(d, (0, 0)) < (8, 0):
            dtypes = ["f32", "f16"]
    return dtypes


def cuda_capabilities(devices: list[str]) -> dict[str, tuple[int, int]]:
    """Compute capability per CUDA device, asked in a child process so this process never
    holds a CUDA context while the benchmarks run."""
    cuda = [d for d in devices if is_cuda(d)]
    if not cuda:
        return {}
    code = ("import json,sys,torch\n"
            "from minivllm.devices import resolve_device\n"
            "out={}\n"
            "for d in sys.argv[1:]:\n"
            "    try:\n"
            "        out[d]=list(torch.cuda.get_device_capability(resolve_device(d)))\n"
            "    except Exception:\n"
            "        pass\n"
            "print(json.dumps(out))\n")
    try:
        res = subprocess.run([sys.executable, "-c", code, *cuda], capture_output=True, text=True, timeout=120)
        return {k: tuple(v) for k, v in json.loads(res.stdout.strip().splitlines()[-1]).items()}
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return {}


def _pick(spec, devices: list[str]):
    if isinstance(spec, dict):
        return spec["cuda" if any(is_cuda(d) for d in devices) else "cpu"]
    return spec


def _expand(args, devices: list[str], options: set[str], ctx: dict, capabilities) -> list[str]:
    out: list[str] = []
    for a in args:
        if a == "{dtypes}":
            for dt in supported_dtypes(devices, capabilities):
                out += ["--activation-dtype", dt]
        elif a.startswith("?"):
            if a[1:] in options:
                out.append(a[1:])
        else:
            out.append(a.format(**ctx))
    return out


def _device_sets(bench: Bench, devices: list[str]) -> list[list[str]] | str:
    """The device lists of this benchmark's runs, or a skip reason."""
    if bench.devices == NONE:
        return [[]]
    if bench.devices == EACH:
        return [[d] for d in devices]
    if bench.devices == ALL:
        return [list(devices)]
    if bench.devices == PAIR:
        if len(devices) >= 2:
            return [list(devices)]
        if devices and is_cuda(devices[0]):
            return [[devices[0], "cpu"]]
        return [["cpu:1", "cpu:1"]]
    if bench.devices == GPU:
        cuda = [d for d in devices if is_cuda(d)]
        return [[d] for d in cuda] if cuda else "needs a CUDA device (none given)"
    if bench.devices == CPU:
        cpu = [d for d in devices if not is_cuda(d)]
        return [[cpu[0]]] if cpu else "CPU only (no CPU device given)"
    raise ValueError(f"unknown device mode {bench.devices!r}")


def plan(devices: list[str], *, quick: bool, only: list[str] | None = None, skip: list[str] | None = None,
         parser: argparse.ArgumentParser | None = None, capabilities: dict | None = None,
         stamp: str = "STAMP", results_dir: str | None = None, python: str | None = None,
         extra_args: dict[str, list[str]] | None = None) -> list[Run]:
    """The runs of `bench all`, in SUITE order, skipped ones included (with a reason)."""
    from minivllm.bench.results import RESULTS_DIR
    from minivllm.bench.common import provenance

    if parser is None:
        from minivllm.cli.main import build_parser
        parser = build_parser()
    names = by_name()
    for n in (only or []) + (skip or []):
        if n not in names:
            raise ValueError(f"unknown benchmark {n!r}; known: {', '.join(names)}")
    results = str(results_dir if results_dir is not None else RESULTS_DIR)
    extra_args = extra_args if extra_args is not None else _env_extra_args()
    python = python or sys.executable
    runs: list[Run] = []
    for b in SUITE:
        if only and b.name not in only:
            continue
        if skip and b.name in skip:
            continue
        sub = command_parser(b.argv, parser)
        base = [python, "-m", "minivllm", *b.argv]
        if sub is None:
            if not b.optional or only:
                runs.append(Run(b.name, b.name, base, [], skip_reason=f"`{' '.join(b.argv)}` is not registered"))
            continue
        spec = b.quick if quick else b.full
        if spec is None:
            runs.append(Run(b.name, b.name, base, [], skip_reason="full suite only"))
            continue
        sets = _device_sets(b, devices)
        if isinstance(sets, str):
            runs.append(Run(b.name, b.name, base, [], skip_reason=sets))
            continue
        options = _options(sub)
        for devs in sets:
            ctx = {"results": results, "tag": device_tag(devs), "stamp": stamp}
            argv = base + _expand(_pick(spec, devs), devs, options, ctx, capabilities)
            if devs and "--inference-device" in options:
                for d in devs:
                    argv += ["--inference-device", d]
            argv += list(extra_args.get(b.name, []))
            name = b.name if len(sets) == 1 or not devs else f"{b.name}[{','.join(devs)}]"
            runs.append(Run(name, b.name, argv, devs))
    return runs


def _env_extra_args() -> dict[str, list[str]]:
    raw = os.environ.get(EXTRA_ARGS_ENV, "").strip()
    if not raw:
        return {}
    data = json.loads(raw)
    return {str(k): [str(x) for x in v] for k, v in data.items()}


# ---------------------------------------------------------------------------- running

def _snapshot(results_dir: Path) -> dict[str, float]:
    if not results_dir.is_dir():
        return {}
    return {p.name: p.stat().st_mtime for p in results_dir.iterdir() if p.is_file()}


def package_commit() -> str | None:
    """The commit of the tree this package runs from ($MINIVLLM_COMMIT wins), so results
    carry it even when `bench all` runs outside the repository; None when not a git tree."""
    if os.environ.get("MINIVLLM_COMMIT"):
        return os.environ["MINIVLLM_COMMIT"]
    root = str(Path(__file__).resolve().parents[2])
    try:
        sha = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             check=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return None
    return sha + ("-dirty" if dirty else "") if sha else None


def _execute(run: Run, results_dir: Path, timeout_s: float | None, echo, commit: str | None = None) -> None:
    before = _snapshot(results_dir)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if commit:
        env["MINIVLLM_COMMIT"] = commit  # results.git_commit() would look at the current directory
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    t0 = time.perf_counter()
    timed_out = threading.Event()
    proc = subprocess.Popen(run.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                            env=env, start_new_session=True)  # own process group: servers die with it

    def kill() -> None:
        timed_out.set()
        _kill_group(proc)

    timer = threading.Timer(timeout_s, kill) if timeout_s else None
    if timer:
        timer.daemon = True
        timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip("\n"))
            echo(line)
        code = proc.wait()
    except KeyboardInterrupt:
        _kill_group(proc)
        proc.wait()
        raise
    finally:
        if timer:
            timer.cancel()
    seconds = time.perf_counter() - t0
    after = _snapshot(results_dir)
    new = sorted(n for n, m in after.items() if before.get(n) != m)
    status = "timeout" if timed_out.is_set() else ("ok" if code == 0 else "failed")
    run.record = {"name": run.name, "benchmark": run.bench, "status": status, "exit_code": code,
                  "seconds": round(seconds, 2), "command": run.argv, "cmdline": run.cmdline,
                  "devices": run.devices, "result_files": [str(results_dir / n) for n in new]}
    if status != "ok":
        run.record["output_tail"] = list(tail)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_suite(devices: list[str], *, quick: bool, only: list[str] | None = None, skip: list[str] | None = None,
              dry_run: bool = False, timeout_s: float | None = None, echo_output: bool = True,
              out=None) -> int:
    """`minivllm bench all`. Returns the exit code: 0 when no benchmark failed."""
    from minivllm.bench import results as _results

    out = out or sys.stdout
    results_dir = Path(_results.RESULTS_DIR)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    capabilities = cuda_capabilities(devices)
    runs = plan(devices, quick=quick, only=only, skip=skip, capabilities=capabilities, stamp=stamp,
                results_dir=str(results_dir))
    mode = "quick" if quick else "full"
    if dry_run:
        print(f"# minivllm bench all ({mode}; devices: {', '.join(devices)}): {len(runs)} runs planned", file=out)
        for r in runs:
            print(f"{r.name}: " + (f"SKIP ({r.skip_reason})" if r.skip_reason else r.cmdline), file=out)
        for k, v in NOT_IMPLEMENTED.items():
            print(f"{k}: NOT IMPLEMENTED ({v})", file=out)
        return 0

    echo = (lambda line: (out.write(line), out.flush())) if echo_output else (lambda line: None)
    commit = package_commit()
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    t_all = time.perf_counter()
    try:
        for i, r in enumerate(runs, 1):
            if r.skip_reason:
                r.record = {"name": r.name, "benchmark": r.bench, "status": "skipped", "reason": r.skip_reason,
                            "seconds": 0.0, "result_files": []}
                print(f"=== [{i}/{len(runs)}] {r.name}: skipped ({r.skip_reason})", file=out, flush=True)
                continue
            print(f"=== [{i}/{len(runs)}] {r.name}: {r.cmdline}", file=out, flush=True)
            _execute(r, results_dir, timeout_s, echo, commit)
            print(f"=== {r.name}: {r.record['status']} (exit {r.record['exit_code']}, {r.record['seconds']:.1f} s)",
                  file=out, flush=True)
    except KeyboardInterrupt:
        print("=== interrupted: writing the index of what ran", file=out, flush=True)
    records = [r.record for r in runs if r.record]
    for r in runs:
        if not r.record:
            records.append({"name": r.name, "benchmark": r.bench, "status": "not run", "seconds": 0.0,
                            "result_files": [], "cmdline": r.cmdline})
    settings = {"mode": mode, "devices": devices, "only": only, "skip": skip, "timeout_s": timeout_s,
                "cuda_capabilities": {k: list(v) for k, v in capabilities.items()}, "started": started,
                "wall_s": round(time.perf_counter() - t_all, 2), "python": sys.executable}
    json_path, md_path = write_index(devices, stamp, settings, records, results_dir, commit=commit)
    failed = [r["name"] for r in records if r["status"] in ("failed", "timeout", "not run")]
    print(f"=== bench all: {sum(r['status'] == 'ok' for r in records)} ok, {len(failed)} failed"
          + (f" ({', '.join(failed)})" if failed else "")
          + f", {sum(r['status'] == 'skipped' for r in records)} skipped; index {json_path} and {md_path}",
          file=out, flush=True)
    return 1 if failed else 0


def write_index(devices: list[str], stamp: str, settings: dict, records: list[dict],
                results_dir: Path, commit: str | None = None) -> tuple[Path, Path]:

    results_dir.mkdir(parents=True, exist_ok=True)
    first = next((d for d in devices if not is_cuda(d) or d.startswith("cuda")), "cpu")
    meta = provenance(first, None, settings)
    if commit:
        meta["commit"] = commit  # the package's tree, also passed to every run as $MINIVLLM_COMMIT
    meta["devices"] = devices
    base = f"bench-all-{device_tag(devices)}-{stamp}"
    json_path, md_path = results_dir / f"{base}.json", results_dir / f"{base}.md"
    json_path.write_text(json.dumps({"benchmark": "bench-all", "provenance": meta, "runs": records,
                                     "not_implemented": NOT_IMPLEMENTED}, indent=2))
    lines = [f"# bench all ({settings['mode']}; {', '.join(devices)})", "",
             "One row per benchmark run; each ran as its own `python -m minivllm ...` process. "
             "Result files are those that appeared in the results directory while it ran.", "",
             "| benchmark | status | seconds | result files |", "|---|---|---|---|"]
    for r in records:
        files = ", ".join(f"[{Path(f).name}]({Path(f).name})" for f in r.get("result_files", []))
        status = r["status"] + (f" ({r['reason']})" if r.get("reason") else "")
        if r["status"] not in ("ok", "skipped") and "exit_code" in r:
            status += f" (exit {r['exit_code']})"
        lines.append(f"| {r['name']} | {status} | {r.get('seconds', 0.0):.1f} | {files} |")
    if NOT_IMPLEMENTED:
        lines += ["", "Not implemented yet:", ""] + [f"- {k}: {v}" for k, v in NOT_IMPLEMENTED.items()]
    for r in records:
        if r.get("output_tail"):
            lines += ["", f"## {r['name']}: {r['status']}", "", f"`{r['cmdline']}`", "", "```",
                      *r["output_tail"], "```"]
    lines += ["", "Commands:", ""] + [f"- {r['name']}: `{r['cmdline']}`" for r in records if r.get("cmdline")]
    lines += ["", "Provenance:", "", "```json", json.dumps(meta, indent=2), "```", ""]
    md_path.write_text("\n".join(lines))
    return json_path, md_path
