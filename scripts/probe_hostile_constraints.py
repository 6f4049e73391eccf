"""Issue 39's first target row, measured: every constraint shape that crashed or stalled the
server, at the size seen and at twice it, against `minivllm serve` with two CPU workers.
For each: the status and how long its answer took, whether the server and both workers
are the same processes afterwards, and the TTFT of the ordinary streams that another
client kept sending meanwhile, beside their TTFT on the idle server.

    python scripts/probe_hostile_constraints.py [--model smollm2-135m] [--baseline 15]

Writes benchmarks/results/hostile-constraints-<model>-<stamp>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from minivllm.bench.common import loadavg, provenance
from minivllm.bench.results import write_results
from minivllm.models.resolve import resolve_model
from minivllm.reliability.hostile_constraints import gbnf_alternatives, shapes

REPO = Path(__file__).resolve().parents[1]
CHAT = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}


def start_server(model_path: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "minivllm", "serve", "--model", str(model_path), "--inference-device", "cpu:1",
           "--inference-device", "cpu:1", "--port", str(port), "--max-model-len", "256",
           "--max-request-bytes", str(8 << 20)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit("the server exited while starting")
        try:
            if httpx.get(url + "/health", timeout=2).json().get("status") == "ok":
                return proc, url
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise SystemExit("the server did not come up in 300 s")


def ttft(url: str) -> float:
    """Seconds from sending an ordinary streamed chat request to its first content chunk."""
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                return time.perf_counter() - t0
    raise RuntimeError("a stream ended with no content")


def hostile(url: str, extra: dict) -> tuple[int, float]:
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", content=json.dumps({**CHAT, **extra}),
                   headers={"content-type": "application/json"}, timeout=300)
    return r.status_code, time.perf_counter() - t0


def probe(url: str, extras: list[dict]) -> dict:
    """Send the hostile bodies at once while another client streams ordinary requests."""
    samples: list[float] = []
    done = threading.Event()

    def others() -> None:
        while not done.is_set() or len(samples) < 3:
            samples.append(ttft(url))

    other = threading.Thread(target=others)
    other.start()
    with ThreadPoolExecutor(len(extras)) as pool:
        answers = list(pool.map(lambda e: hostile(url, e), extras))
    done.set()
    other.join()
    return {"statuses": sorted({s for s, _ in answers}), "answer_s": max(t for _, t in answers), "ttfts": samples}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--baseline", type=int, default=15, help="ordinary requests timed on the idle server")
    args = ap.parse_args()
    model_path = resolve_model(args.model)
    proc, url = start_server(model_path)
    try:
        health = httpx.get(url + "/health", timeout=5).json()
        ttft(url)  # warm-up
        base = [ttft(url) for _ in range(args.baseline)]
        base_median = statistics.median(base)
        print(f"baseline TTFT: median {base_median * 1e3:.0f} ms over {len(base)}", flush=True)
        rows = []
        cases = [(name, scale, [extra]) for scale in (1.0, 2.0) for name, extra in shapes(scale).items()]
        for scale in (1.0, 2.0):  # the "two 272 KB grammars at once"
            cases.append(("gbnf-alternatives x2 at once", scale,
                          [{"guided_grammar": gbnf_alternatives(int(28_000 * scale))}] * 2))
        for name, scale, extras in cases:
            got = probe(url, extras)
            same = proc.poll() is None and httpx.get(url + "/health", timeout=5).json() == health
            t = got["ttfts"]
            row = {"shape": name, "scale": scale, "status": ",".join(map(str, got["statuses"])),
                   "answer_s": got["answer_s"], "other_ttft_median_ms": statistics.median(t) * 1e3,
                   "other_ttft_max_ms": max(t) * 1e3, "ttft_ratio": statistics.median(t) / base_median,
                   "others": len(t), "server_and_workers_same": same}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    meta = provenance("cpu", None, {"model": args.model, "workers": "2 x cpu:1", "baseline_ttft_ms": base,
                                    "loadavg": loadavg()})
    cols = ["shape", "scale", "status", "answer_s", "other_ttft_median_ms", "other_ttft_max_ms", "ttft_ratio",
            "others", "server_and_workers_same"]
    notes = (f"Baseline TTFT of an ordinary streamed request on the idle server: median {base_median * 1e3:.0f} ms "
             f"(mean {statistics.mean(base) * 1e3:.0f} ± {statistics.stdev(base) * 1e3:.0f} ms, {len(base)} requests). "
             "ttft_ratio = the other streams' median TTFT while the hostile request was in flight ÷ that baseline.")
    for p in write_results(f"hostile-constraints-{args.model}", meta, rows, cols, notes):
        print(p)


if __name__ == "__main__":
    main()
