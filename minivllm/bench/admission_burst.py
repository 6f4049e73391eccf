"""A burst of long prompts against short ones, with and without the queued-prompt-token limit.

    minivllm bench admission [--rounds 2] [--limit 1024]

One SmolLM2-135M CPU worker (one thread) behind the real HTTP server, a fresh cluster per
setting. At t = 0, LONG prompts of ~400 tokens (max_tokens 1) arrive at once; from
t = 0.5 s, SHORT prompts of ~12 tokens (max_tokens 8) arrive every 0.25 s. Every request
streams; TTFT is the time from sending to the first SSE chunk with text (what a user
waits for). Without a limit the short prompts queue behind every long prefill (FCFS);
with `max_queued_prompt_tokens` the long prompts past the bound get a 429 at once and the
short ones wait for at most the bound's worth of prefill. Results (JSON + Markdown with
provenance) go to benchmarks/results/admission-burst-*.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import httpx
import numpy as np

from minivllm.bench.common import provenance
from minivllm.bench.results import write_results
from minivllm.models import resolve_model
from minivllm.models.cache import sha256_file
from minivllm.serving import Cluster
from minivllm.serving.http_server import start_server_in_background

LONG, SHORT = 12, 8


async def one(client, url, prompt, max_tokens, delay):
    await asyncio.sleep(delay)
    sent = time.monotonic()
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, time.monotonic() - sent
        async for line in r.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("text"):
                return 200, time.monotonic() - sent
        return 200, time.monotonic() - sent


def run_once(model_path, limit, round_no):
    cluster = Cluster(str(model_path), ["cpu:1"], router="round-robin", max_model_len=512, calibrate=False,
                      max_queued_prompt_tokens=limit).start()
    srv = start_server_in_background(cluster)
    try:
        async def burst():
            async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as client:
                longs = [
                    one(client, srv.url, f"r{round_no} long {i}: " + " ".join(f"w{i}x{j}" for j in range(80)), 1, 0.0)
                    for i in range(LONG)
                ]
                shorts = [
                    one(client, srv.url, f"r{round_no} short {i}: say hello", 8, 0.5 + 0.25 * i) for i in range(SHORT)
                ]
                results = await asyncio.gather(*longs, *shorts)
                return results[:LONG], results[LONG:]

        longs, shorts = asyncio.run(burst())
    finally:
        srv.stop()
        cluster.stop()
    short_ttft = [t for s, t in shorts if s == 200]
    long_ok = [t for s, t in longs if s == 200]
    return {"limit": limit if limit is not None else "none", "round": round_no,
            "short_ok": len(short_ttft), "short_ttft_p50_s": statistics.median(short_ttft),
            "short_ttft_p99_s": float(np.percentile(short_ttft, 99)), "short_ttft_max_s": max(short_ttft),
            "long_ok": len(long_ok), "long_429": sum(s == 429 for s, _ in longs),
            "long_ttft_p50_s": statistics.median(long_ok) if long_ok else None}


def run(rounds: int = 2, limit: int = 1024, model: str = "smollm2-135m") -> tuple:
    """Alternate the two settings for `rounds` rounds; write and return the result files."""
    model_path = resolve_model(model, progress=False)
    rows = []
    for r in range(rounds):
        for setting in (None, limit):  # alternate, so drift on a shared machine hits both
            row = run_once(model_path, setting, r)
            print(row, flush=True)
            rows.append(row)
    settings = {"model": model, "worker": "cpu:1", "long": LONG, "long_prompt_tokens": "~400, max_tokens 1",
                "short": SHORT, "short_prompt_tokens": "~12, max_tokens 8", "short_arrivals": "0.5 s + 0.25 s steps",
                "limits": ["none", limit]}
    columns = ["limit", "round", "short_ok", "short_ttft_p50_s", "short_ttft_p99_s", "short_ttft_max_s", "long_ok",
               "long_429", "long_ttft_p50_s"]
    paths = write_results("admission-burst", provenance("cpu", sha256_file(model_path), settings), rows, columns,
                          notes=__doc__.split("\n\n")[2])
    print(*paths)
    return paths
