"""Running `bench all`'s plan: each benchmark in its own process group, its output echoed and its
tail kept, the result files that appeared while it ran; then the index bench-all-<devices>-<stamp>."""

from __future__ import annotations

import collections
import datetime as _dt
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from minivllm.bench.common import provenance
from minivllm.bench.suite.plan import Run, cuda_capabilities, device_tag, is_cuda, plan
from minivllm.bench.suite.table import NOT_IMPLEMENTED

TAIL_LINES = 40


def _snapshot(results_dir: Path) -> dict[str, float]:
    if not results_dir.is_dir():
        return {}
    return {p.name: p.stat().st_mtime for p in results_dir.iterdir() if p.is_file()}


def package_commit() -> str | None:
    """The commit of the tree this package runs from ($MINIVLLM_COMMIT wins), so results
    carry it even when `bench all` runs outside the repository; None when not a git tree."""
    if os.environ.get("MINIVLLM_COMMIT"):
        return os.environ["MINIVLLM_COMMIT"]
    root = str(Path(__file__).resolve().parents[3])
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
