"""`minivllm bench serve`: an online load generator for any OpenAI-compatible server.

It sends `num_prompts` streamed requests (`stream: true`, `stream_options.include_usage`)
to /v1/completions or /v1/chat/completions of a running server (minivllm, vLLM,
llama-cpp-python, llama.cpp's server, ...), arriving as a Poisson process or in bursts, at
most `max_concurrency` in flight, and reports the serving metrics with the usual
definitions (those of vLLM's benchmark_serving.py):

    TTFT        first content chunk - send                      (per request)
    ITL         gaps between consecutive content chunks         (pooled over requests)
    TPOT        (E2E - TTFT) / (output_tokens - 1)              (per request; 1-token requests skipped)
    E2E         end of the stream - send                        (per request)
    request throughput        completed requests / duration
    output token throughput   total output tokens / duration
    total token throughput    (total prompt + output tokens) / duration
    goodput                   requests meeting every SLO given (TTFT <= slo_ttft, TPOT <= slo_tpot) / duration

each latency as mean, median, p90, p99, std (population, as numpy.std) in the JSON; the
table shows mean, median, p99 and std. "Send" is when the request leaves the client (after
it waits for its arrival time and for a free `max_concurrency` slot); "duration" runs from
the first arrival to the end of the last request. A "content chunk" is an SSE chunk whose
`choices` list is not empty (a token's text, possibly empty, or the finish reason; the
usage-only chunk does not count), as in vLLM's benchmark. Output tokens come from the
server's `usage.completion_tokens` (else: the content chunks that carry a token, marked so);
prompt tokens from `usage.prompt_tokens` (else the requested input length, marked so).

A request fails on a non-200 answer, an error chunk inside the stream, a transport error
or timeout, or a stream with no content chunk or that ends without `[DONE]` and without
a finish_reason. Failed requests are counted (with the first few error messages) and left
out of every metric.

Prompts: synthetic text of random common English words, one seeded list shared by every
server in a run. With a local tokenizer (`--tokenizer` MODEL, or the model of
`--start-server`) each prompt is cut to exactly the requested number of tokens (the server
may add a BOS, and the chat endpoint adds its template); without one the input length is
approximate: one word per token (these common words are one token each with SmolLM2's
tokenizer, and with most BPE vocabularies; general prose runs nearer 1.3 tokens per word).
The actual prompt tokens come back in `usage` and are what the table reports. Requests are
greedy (temperature 0) and `ignore_eos` by default, so output lengths match `--output-len`
on servers that honour `ignore_eos` or `min_tokens` (minivllm, vLLM, llama-cpp-python); the summary counts requests whose
output length differs from the requested one.

Usage:

    # one server already running
    minivllm bench serve --url http://127.0.0.1:8000 --label minivllm \\
        --num-prompts 200 --request-rate 4 --max-concurrency 16 --input-len 128 --output-len 128

    # start `python -m minivllm serve` here, load it, stop it
    minivllm bench serve --start-server --model smollm2-135m --inference-device cpu:1 \\
        --num-prompts 20 --request-rate 2 --output-len 32

    # bursts, uniform lengths, SLOs (goodput), chat endpoint
    minivllm bench serve --url http://127.0.0.1:8000 --endpoint chat --arrival burst --burst-size 16 \\
        --burst-gap-s 5 --input-len-range 32:256 --output-len-range 16:128 --slo-ttft-ms 500 --slo-tpot-ms 50

    # several servers, one after another, identical seeded requests; ratios vs the first label
    minivllm bench serve --url http://127.0.0.1:8000 --label minivllm \\
        --url http://127.0.0.1:8001 --label llama-cpp-python --num-prompts 100 --request-rate 2

Options: --model (the `model` field; default: the first id of GET /v1/models; repeatable,
one per --url, or one for all), --api-key, --endpoint completions|chat, --num-prompts,
--arrival poisson|burst, --request-rate (req/s of the Poisson process; inf, the default,
sends everything at once), --burst-size/--burst-gap-s, --max-concurrency, --input-len/
--output-len or --input-len-range A:B/--output-len-range A:B (uniform), --seed,
--[no-]ignore-eos, --temperature, --slo-ttft-ms/--slo-tpot-ms, --warmup (unmeasured
requests first, default 1), --tokenizer, --request-timeout, --out, --tag; --start-server
with --model (the model to serve), --inference-device (repeatable), --serve-arg (extra
`minivllm serve` arguments, repeatable, --serve-arg=--flag) and --ready-timeout. With
--start-server the started server is the first target (label "minivllm" unless --label
says otherwise) and any --url targets follow it.

Results: benchmarks/results/serve-<label>[-<tag>]-<stamp>.json (provenance of this client:
commit, local versions; the target URL, the server's /v1/models and /health answers, every
setting; the summary; every request's timings) and .md with the table; with several
targets also serve-compare-<label>-vs-<label>...[-<tag>]-<stamp>.json/.md with one table,
a column per label and a ratio column per label against the first. The command prints
the table and exits 1 when a target completed no request at all.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import json
import math
import random
import re
import statistics
import sys
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from minivllm.bench.common import percentile, provenance

# Common English words; with SmolLM2's (Llama-style BPE) tokenizer nearly every " word" is one token.
WORDS = """the of and to in is was for on are with as be at by this had not but from have they which one you
were her all she there would their we him been has when who will more no if out so said what up its about into
than them can only other new some could time these two may then do first any my now such like our over man me
even most made after also did many before must through back years where much your way well down should because
each just those people how too little state good very make world still own see men work long get here between
both life being under never day same another know while last might us great old year off come since against go
came right used take three states himself few house use during without again place around however home small
found thought went say part once general high upon school every does got united left number course war until
always away something fact though water less public put think almost hand enough far took head yet government
system better set told nothing night end why called find going look asked later point knew city next program
business give group toward young days let room president side social given present several order national second
possible rather per face among form important often things looked early white case john become large big need four
within felt along children saw best church ever least power development light thing seemed family interest want
members mind country area others done turned help open certain problem sense kind began taken real""".split()
TOKENS_PER_WORD = 1.0  # measured: SmolLM2's tokenizer encodes prompts of these words at exactly one token a word
WARMUP_PROMPT = "Hello, this is a warm-up request."


@dataclass
class LoadSettings:
    endpoint: str = "completions"  # "completions" | "chat"
    num_prompts: int = 200
    arrival: str = "poisson"  # "poisson" | "burst"
    request_rate: float = math.inf  # Poisson arrivals per second; inf: all at once
    burst_size: int = 10
    burst_gap_s: float = 1.0
    max_concurrency: int | None = None
    input_len: int = 128
    output_len: int = 128
    input_len_range: tuple[int, int] | None = None  # uniform A..B instead of input_len
    output_len_range: tuple[int, int] | None = None
    seed: int = 0
    ignore_eos: bool = True
    temperature: float = 0.0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    request_timeout_s: float = 600.0

    def __post_init__(self):
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be completions or chat, not {self.endpoint!r}")
        if self.arrival not in ("poisson", "burst"):
            raise ValueError(f"arrival must be poisson or burst, not {self.arrival!r}")
        if self.num_prompts < 1:
            raise ValueError("num_prompts must be >= 1")
        if not self.request_rate > 0:
            raise ValueError("request_rate must be > 0 (inf: all at once)")
        if self.burst_size < 1 or self.burst_gap_s < 0:
            raise ValueError("burst_size must be >= 1 and burst_gap_s >= 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        for name in ("input_len_range", "output_len_range"):
            r = getattr(self, name)
            if r is not None:
                r = tuple(int(x) for x in r)
                if len(r) != 2 or not 1 <= r[0] <= r[1]:
                    raise ValueError(f"{name} must be (A, B) with 1 <= A <= B, not {r!r}")
                setattr(self, name, r)
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("input_len and output_len must be >= 1")

    def max_input_len(self) -> int:
        return self.input_len_range[1] if self.input_len_range else self.input_len

    def max_output_len(self) -> int:
        return self.output_len_range[1] if self.output_len_range else self.output_len


@dataclass
class RequestSpec:
    index: int
    prompt: str
    input_len: int  # requested prompt length in tokens (exact with a tokenizer, else approximate)
    output_len: int  # max_tokens
    arrival_s: float  # offset from the start of the run


@dataclass
class RequestResult:
    """One request; times are perf_counter seconds relative to the start of the run."""

    index: int
    input_len: int
    output_len: int
    ok: bool = False
    error: str | None = None
    status: int | None = None
    send_s: float = 0.0
    chunk_s: list[float] = field(default_factory=list)  # arrival of each content chunk
    end_s: float | None = None
    prompt_tokens: int | None = None  # from usage
    output_tokens: int | None = None  # from usage, else the number of token-carrying chunks
    tokens_from: str | None = None  # "usage" | "chunks"
    finish_reason: str | None = None
    text_chars: int = 0
    token_chunks: int = 0  # content chunks that carry a token (not a bare finish_reason)
    got_done: bool = False

    def fail(self, error: str, t: float) -> None:
        self.ok, self.error, self.end_s = False, error, t


# -- metric math (pure) ---------------------------------------------------------------------------


def request_metrics(send_s: float, chunk_s: list[float], end_s: float, output_tokens: int) -> dict:
    """TTFT, ITLs, TPOT and E2E (seconds) of one request from its timestamps.
    TPOT is None for requests of fewer than 2 output tokens."""
    if not chunk_s:
        raise ValueError("a request without content chunks has no TTFT")
    ttft = chunk_s[0] - send_s
    e2e = end_s - send_s
    itl = [b - a for a, b in zip(chunk_s, chunk_s[1:])]
    tpot = (e2e - ttft) / (output_tokens - 1) if output_tokens and output_tokens > 1 else None
    return {"ttft_s": ttft, "e2e_s": e2e, "tpot_s": tpot, "itl_s": itl}


def stats(values: list[float]) -> dict:
    if not values:
        return {"n": 0, "mean": None, "median": None, "p90": None, "p99": None, "std": None, "min": None, "max": None}
    return {"n": len(values), "mean": statistics.fmean(values), "median": percentile(values, 50),
            "p90": percentile(values, 90), "p99": percentile(values, 99), "std": statistics.pstdev(values),
            "min": min(values), "max": max(values)}


def meets_slo(m: dict, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    if slo_ttft_ms is not None and not m["ttft_s"] * 1000.0 <= slo_ttft_ms:
        return False
    if slo_tpot_ms is not None and m["tpot_s"] is not None and not m["tpot_s"] * 1000.0 <= slo_tpot_ms:
        return False
    return True


def summarize(results: list[RequestResult], duration_s: float, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None, ignore_eos: bool = True) -> dict:
    """The run's metrics from its requests (failed ones counted, and left out of every metric)."""
    ok = [r for r in results if r.ok]
    per = [request_metrics(r.send_s, r.chunk_s, r.end_s, r.output_tokens) for r in ok]
    duration_s = max(duration_s, 1e-9)
    output_tokens = sum(r.output_tokens for r in ok)
    usage_prompt = all(r.prompt_tokens is not None for r in ok)
    input_tokens = sum((r.prompt_tokens if usage_prompt else r.input_len) for r in ok)
    slo_given = slo_ttft_ms is not None or slo_tpot_ms is not None
    good = sum(meets_slo(m, slo_ttft_ms, slo_tpot_ms) for m in per)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = (r.error or "?")[:300]
            errors[key] = errors.get(key, 0) + 1
    ms = lambda xs: [x * 1000.0 for x in xs]  # noqa: E731
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "input_tokens_from": "usage" if usage_prompt else "requested lengths (approximate)",
        "total_output_tokens": output_tokens,
        "output_tokens_from": "usage" if all(r.tokens_from == "usage" for r in ok) else "content chunks (approximate)",
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tpot_ms": slo_tpot_ms,
        "good_requests": good if slo_given else None,
        "goodput": good / duration_s if slo_given else None,
        "ttft_ms": stats(ms(m["ttft_s"] for m in per)),
        "tpot_ms": stats(ms(m["tpot_s"] for m in per if m["tpot_s"] is not None)),
        "itl_ms": stats(ms(x for m in per for x in m["itl_s"])),
        "e2e_ms": stats(ms(m["e2e_s"] for m in per)),
        "prompt_tokens": stats([r.prompt_tokens for r in ok if r.prompt_tokens is not None]),
        "output_tokens": stats([r.output_tokens for r in ok]),
        "output_len_mismatch": sum(r.output_tokens != r.output_len for r in ok) if ignore_eos else None,
        "peak_in_flight": peak_in_flight(results),
        "errors": [{"error": k, "count": v} for k, v in sorted(errors.items(), key=lambda kv: -kv[1])[:5]],
    }


def peak_in_flight(results: list[RequestResult]) -> int:
    events = sorted([(r.send_s, 1) for r in results if r.end_s is not None]
                    + [(r.end_s, -1) for r in results if r.end_s is not None], key=lambda e: (e[0], e[1]))
    peak = cur = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


# -- the workload ---------------------------------------------------------------------------------


def arrival_offsets(settings: LoadSettings) -> list[float]:
    """Seconds from the start at which each request arrives (first at 0)."""
    n = settings.num_prompts
    if settings.arrival == "burst":
        return [(i // settings.burst_size) * settings.burst_gap_s for i in range(n)]
    if math.isinf(settings.request_rate):
        return [0.0] * n
    rng = random.Random(settings.seed + 1)
    out, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(settings.request_rate)
        out.append(t)
    return out


def synthetic_prompt(rng: random.Random, n_tokens: int, tokenizer=None) -> str:
    """Random common words: about `n_tokens` tokens, exactly that many with a tokenizer."""
    if tokenizer is None:
        return " ".join(rng.choice(WORDS) for _ in range(max(1, round(n_tokens / TOKENS_PER_WORD))))
    words = [rng.choice(WORDS) for _ in range(n_tokens + 8)]
    ids = tokenizer.encode(" ".join(words), add_bos=False, parse_special=False)
    while len(ids) < n_tokens:  # never with these words; just in case
        words += [rng.choice(WORDS) for _ in range(n_tokens)]
        ids = tokenizer.encode(" ".join(words), add_bos=False, parse_special=False)
    return tokenizer.decode(ids[:n_tokens])


def make_requests(settings: LoadSettings, tokenizer=None) -> list[RequestSpec]:
    rng = random.Random(settings.seed)
    arrivals = arrival_offsets(settings)
    out = []
    for i in range(settings.num_prompts):
        n_in = rng.randint(*settings.input_len_range) if settings.input_len_range else settings.input_len
        n_out = rng.randint(*settings.output_len_range) if settings.output_len_range else settings.output_len
        out.append(RequestSpec(i, synthetic_prompt(rng, n_in, tokenizer), n_in, n_out, arrivals[i]))
    return out


def request_body(spec_prompt: str, max_tokens: int, settings: LoadSettings, model: str | None) -> dict:
    body: dict = {"max_tokens": max_tokens, "temperature": settings.temperature, "stream": True,
                  "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    if settings.ignore_eos:
        # ignore_eos is vLLM's and minivllm's; min_tokens is how vLLM and llama-cpp-python's
        # server keep EOS from ending a request early. Servers ignore the field they lack.
        body["ignore_eos"] = True
        body["min_tokens"] = max_tokens
    if settings.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec_prompt}]
    else:
        body["prompt"] = spec_prompt
    return body


# -- the client -----------------------------------------------------------------------------------


def endpoint_path(endpoint: str) -> str:
    return "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"


async def stream_request(client, path: str, body: dict, rec: RequestResult, clock) -> None:
    """POST one streamed request and fill `rec` (send time, content chunk times, end, usage, outcome)."""
    import httpx

    rec.send_s = clock()
    try:
        async with client.stream("POST", path, json=body) as r:
            rec.status = r.status_code
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                rec.fail(f"HTTP {r.status_code}: {text[:300]}", clock())
                return
            usage = None
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, ": ping" comments, "event:" lines
                payload = line[5:].strip()
                if payload == "[DONE]":
                    rec.got_done = True
                    break
                t = clock()
                try:
                    obj = json.loads(payload)
                except ValueError:
                    rec.fail(f"bad JSON chunk: {payload[:200]!r}", t)
                    return
                if not isinstance(obj, dict):
                    rec.fail(f"not a JSON object: {payload[:200]!r}", t)
                    return
                if obj.get("error"):
                    err = obj["error"]
                    rec.fail("error chunk: " + (err.get("message") if isinstance(err, dict) else str(err))[:300], t)
                    return
                choices = obj.get("choices") or []
                if choices:
                    rec.chunk_s.append(t)
                    c = choices[0] if isinstance(choices[0], dict) else {}
                    text = c.get("text")
                    if text is None:
                        text = (c.get("delta") or {}).get("content")
                    rec.text_chars += len(text or "")
                    # Some servers (llama-cpp-python) end with a chunk holding only the finish
                    # reason: not a token when counting tokens without usage.
                    if text or not c.get("finish_reason"):
                        rec.token_chunks += 1
                    if c.get("finish_reason"):
                        rec.finish_reason = c["finish_reason"]
                if obj.get("usage"):
                    usage = obj["usage"]
            end = clock()
    except httpx.HTTPError as exc:
        rec.fail(f"{type(exc).__name__}: {exc}"[:300], clock())
        return
    except Exception as exc:  # noqa: BLE001 - an odd chunk shape fails this request, not the run
        rec.fail(f"client error: {exc!r}"[:300], clock())
        return
    if not rec.chunk_s:
        rec.fail("the stream carried no content chunk", end)
    elif not rec.got_done and rec.finish_reason is None:
        rec.fail(f"the stream ended without [DONE] or a finish_reason after {len(rec.chunk_s)} chunks", end)
    else:
        rec.ok, rec.end_s = True, end
        if usage and usage.get("completion_tokens") is not None:
            rec.output_tokens, rec.tokens_from = int(usage["completion_tokens"]), "usage"
        else:
            rec.output_tokens, rec.tokens_from = rec.token_chunks, "chunks"
        if usage and usage.get("prompt_tokens") is not None:
            rec.prompt_tokens = int(usage["prompt_tokens"])


def _headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _client(url: str, api_key: str | None, timeout_s: float):
    import httpx

    return httpx.AsyncClient(base_url=url, headers=_headers(api_key), timeout=httpx.Timeout(timeout_s, connect=60.0),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))


async def drive(url: str, specs: list[RequestSpec], settings: LoadSettings, *, model: str | None,
                api_key: str | None = None, warmup: int = 1, progress: bool = True,
                label: str = "") -> tuple[list[RequestResult], float]:
    """Send the requests at their arrival times (at most max_concurrency in flight); returns
    the results and the duration (first arrival to the end of the last request)."""
    path = endpoint_path(settings.endpoint)
    sem = asyncio.Semaphore(settings.max_concurrency) if settings.max_concurrency else None
    results = [RequestResult(s.index, s.input_len, s.output_len) for s in specs]
    async with _client(url, api_key, settings.request_timeout_s) as client:
        for i in range(warmup):
            rec = RequestResult(-1 - i, 0, 4)
            await stream_request(client, path, request_body(WARMUP_PROMPT, 4, settings, model), rec, time.perf_counter)
            if not rec.ok:
                raise RuntimeError(f"bench serve: the warm-up request to {url}{path} failed: {rec.error}")
        t0 = time.perf_counter()
        clock = lambda: time.perf_counter() - t0  # noqa: E731
        done = 0
        step = max(1, len(specs) // 10)

        async def one(spec: RequestSpec, rec: RequestResult) -> None:
            nonlocal done
            body = request_body(spec.prompt, spec.output_len, settings, model)
            if sem is None:
                await stream_request(client, path, body, rec, clock)
            else:
                async with sem:
                    await stream_request(client, path, body, rec, clock)
            done += 1
            if progress and (done % step == 0 or done == len(specs)):
                failed = sum(1 for r in results if r.end_s is not None and not r.ok)
                print(f"bench serve{' ' + label if label else ''}: {done}/{len(specs)} done after {clock():.1f} s"
                      + (f" ({failed} failed)" if failed else ""), flush=True)

        tasks = []
        for spec, rec in zip(specs, results):
            delay = spec.arrival_s - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(spec, rec)))
        await asyncio.gather(*tasks)
        duration = clock()
    return results, duration


# -- server probing and the optional local server --------------------------------------------------


def probe(url: str, api_key: str | None) -> dict:
    """GET /v1/models (required) and /health (optional) of the server."""
    import httpx

    try:
        r = httpx.get(url + "/v1/models", headers=_headers(api_key), timeout=30)
        r.raise_for_status()
        models = r.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise RuntimeError(f"bench serve: GET {url}/v1/models failed: {type(exc).__name__}: {exc}") from exc
    health = None
    try:
        h = httpx.get(url + "/health", headers=_headers(api_key), timeout=10)
        if h.status_code == 200:
            health = h.json() if "json" in h.headers.get("content-type", "") else h.text[:500]
    except (httpx.HTTPError, ValueError):
        pass
    return {"v1_models": models, "health": health}


def _safe(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", label).strip("-") or "server"


def default_label(url: str) -> str:
    return _safe(re.sub(r"^https?://", "", url))


def _load_tokenizer(name_or_path: str):
    from minivllm.gguf.tokenizer import Tokenizer
    from minivllm.models import resolve_model

    return Tokenizer.from_gguf(resolve_model(name_or_path, progress=False))


def _jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


# -- the whole run --------------------------------------------------------------------------------


def run(urls: list[str] | None = None, labels: list[str] | None = None, settings: LoadSettings | None = None, *,
        models: list[str] | None = None, api_key: str | None = None, start_server: str | None = None,
        inference_devices: list[str] | None = None, serve_args: list[str] | None = None,
        tokenizer: str | None = None, warmup: int = 1, out_dir: str | Path | None = None, tag: str | None = None,
        ready_timeout_s: float = 900.0, progress: bool = True, write: bool = True,
        start_peer: str | None = None, peer_threads: int | None = None, peer_gpu_layers: int = 0,
        llama_cpp_path: str | None = None) -> dict:
    """Load each target in turn with the same seeded requests; returns {"targets": [...], "table": str,
    "files": [...]}. `start_server`: a model to serve with `python -m minivllm serve` (the first target).
    `start_peer="llama-cpp-python"`: then start llama-cpp-python's server on the same GGUF file
    (the second target; `peer_threads` CPU threads, default the machine's cores; `peer_gpu_layers`)."""
    from minivllm.bench import results as _results

    settings = settings or LoadSettings()
    urls = [u.rstrip("/") for u in (urls or [])]
    if start_peer is not None:
        from minivllm.bench.llama_cpp_server import LABEL, check_installed

        if start_peer != LABEL:
            raise ValueError(f"bench serve: --start-peer {start_peer!r}: the only peer it can start is {LABEL!r}")
        if not start_server:
            raise ValueError("bench serve: --start-peer serves the --start-server model; give --start-server too")
        check_installed(llama_cpp_path)
    n_targets = len(urls) + (1 if start_server else 0) + (1 if start_peer else 0)
    if n_targets == 0:
        raise ValueError("bench serve: give --url (repeatable) or --start-server")
    if labels and len(labels) != n_targets:
        raise ValueError(f"bench serve: {len(labels)} labels for {n_targets} servers (give one --label per server, "
                         "in order; the started server comes first)")
    url_models = list(models or [])
    if url_models and len(url_models) not in (1, len(urls)):
        raise ValueError(f"bench serve: {len(url_models)} --model values for {len(urls)} --url targets "
                         "(give one for all, or one per --url)")
    tok, tok_name = None, tokenizer or start_server
    if tok_name:
        try:
            tok = _load_tokenizer(tok_name)
        except Exception as exc:  # noqa: BLE001 - sizing by words still works
            print(f"bench serve: tokenizer {tok_name!r} not available ({exc}); prompt lengths are approximate", flush=True)
            tok_name = None
    specs = make_requests(settings, tok)
    out = Path(out_dir) if out_dir else _results.RESULTS_DIR
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    targets: list[dict] = []
    server = None
    try:
        plan = []
        if start_server:
            plan.append(("start", None, None))
        if start_peer:
            plan.append(("peer", None, None))
        for i, u in enumerate(urls):
            plan.append(("url", u, url_models[0] if len(url_models) == 1 else (url_models[i] if url_models else None)))
        for k, (kind, url, model) in enumerate(plan):
            model_sha = None
            serve_cmd = None
            if kind == "start":
                from minivllm.bench.server_process import ServerProcess
                from minivllm.models import resolve_model
                from minivllm.models.cache import sha256_file
                from minivllm.serving.http_server import free_port

                model_path = resolve_model(start_server, progress=progress)
                model_sha = sha256_file(Path(model_path))
                port = free_port()
                serve_cmd = ["--model", str(start_server), "--port", str(port)]
                for d in inference_devices or []:
                    serve_cmd += ["--inference-device", d]
                if api_key:
                    serve_cmd += ["--api-key", api_key]
                serve_cmd += list(serve_args or [])
                if progress:
                    print("bench serve: starting python -m minivllm serve " + " ".join(serve_cmd), flush=True)
                log = Path(tempfile.mkdtemp(prefix="minivllm-bench-serve-")) / "serve.log"
                server = ServerProcess(serve_cmd, port, log).start(ready_timeout_s)
                url = server.url
            elif kind == "peer":
                from minivllm.bench.llama_cpp_server import LABEL, LlamaCppServer
                from minivllm.models import resolve_model
                from minivllm.models.cache import sha256_file
                from minivllm.serving.http_server import free_port

                model_path = resolve_model(start_server, progress=progress)
                model_sha = sha256_file(Path(model_path))
                threads = peer_threads or len(os.sched_getaffinity(0))
                # Room for the longest prompt and output of the run (plus a chat template's tokens).
                n_ctx = max(512, settings.max_input_len() + settings.max_output_len() + 64)
                log = Path(tempfile.mkdtemp(prefix="minivllm-bench-serve-")) / "llama-cpp-server.log"
                server = LlamaCppServer(model_path, free_port(), log, threads=threads, n_ctx=n_ctx,
                                        gpu_layers=peer_gpu_layers, llama_cpp_path=llama_cpp_path)
                serve_cmd = server.command()[1:]
                if progress:
                    print("bench serve: starting python " + " ".join(serve_cmd), flush=True)
                server.start(ready_timeout_s)
                url = server.url
            label = labels[k] if labels else ({"start": "minivllm", "peer": "llama-cpp-python"}.get(kind)
                                              or default_label(url))
            info = probe(url, api_key)
            served = [m.get("id") for m in (info["v1_models"].get("data") or []) if isinstance(m, dict)]
            send_model = model or (served[0] if served else None)
            if progress:
                print(f"bench serve {label}: {len(specs)} requests to {url}{endpoint_path(settings.endpoint)} "
                      f"(model {send_model!r})", flush=True)
            results, duration = asyncio.run(drive(url, specs, settings, model=send_model, api_key=api_key,
                                                  warmup=warmup, progress=progress, label=label))
            exit_code = None
            if kind in ("start", "peer") and server is not None:
                exit_code, server = server.stop(), None
            summary = summarize(results, duration, settings.slo_ttft_ms, settings.slo_tpot_ms, settings.ignore_eos)
            cfg = {"bench": "serve", **asdict(settings), "warmup": warmup, "tokenizer": tok_name,
                   "prompt_sizing": "exact (tokenizer)" if tok is not None else f"approximate (words * {TOKENS_PER_WORD})"}
            prov = provenance("cpu", model_sha, _jsonable(cfg))
            prov["device_note"] = "`device` is the load generator's machine; the server is described under `target`"
            target = {
                "benchmark": "serve", "label": label, "provenance": prov,
                "target": {"url": url, "model": send_model, "started_here": serve_cmd, **info,
                           **({"server_exit_code": exit_code} if serve_cmd else {})},
                "notes": _notes(settings, len(specs), url, send_model, tok is not None),
                "summary": summary,
                "requests": [_request_row(r) for r in results],
            }
            targets.append(_jsonable(target))
            if write:
                name = f"serve-{_safe(label)}" + (f"-{_safe(tag)}" if tag else "") + f"-{stamp}"
                if any(Path(f).name == f"{name}.json" for t in targets[:-1] for f in t.get("files", [])):
                    name += f"-{k + 1}"  # the same label twice in one run
                files = _write(out, name, targets[-1], markdown([targets[-1]]))
                targets[-1]["files"] = [str(f) for f in files]
    finally:
        if server is not None:
            server.stop()
    result = {"targets": targets, "table": table(targets), "files": [f for t in targets for f in t.get("files", [])]}
    if write and len(targets) > 1:
        name = "serve-compare-" + "-vs-".join(_safe(t["label"]) for t in targets) + (f"-{_safe(tag)}" if tag else "") + f"-{stamp}"
        combined = {"benchmark": "serve-compare", "labels": [t["label"] for t in targets],
                    "provenance": targets[0]["provenance"],
                    "targets": [{k: t[k] for k in ("label", "target", "notes", "summary", "files")} for t in targets]}
        result["files"] += [str(f) for f in _write(out, name, combined, markdown(targets))]
    if progress:
        print()
        print(result["table"])
        for t in targets:
            for e in t["summary"]["errors"]:
                print(f"  {t['label']}: {e['count']} x {e['error']}")
        for f in result["files"]:
            print(f"  wrote {f}")
        sys.stdout.flush()
    return result


def _request_row(r: RequestResult) -> dict:
    row = {"index": r.index, "ok": r.ok, "error": r.error, "status": r.status, "input_len": r.input_len,
           "output_len": r.output_len, "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
           "tokens_from": r.tokens_from, "finish_reason": r.finish_reason, "send_s": r.send_s, "end_s": r.end_s,
           "chunk_s": r.chunk_s, "ttft_s": None, "e2e_s": None, "tpot_s": None}
    if r.ok:
        m = request_metrics(r.send_s, r.chunk_s, r.end_s, r.output_tokens)
        row.update(ttft_s=m["ttft_s"], e2e_s=m["e2e_s"], tpot_s=m["tpot_s"])
    return row


def _notes(s: LoadSettings, n: int, url: str, model: str | None, exact: bool) -> str:
    arrival = (f"bursts of {s.burst_size} every {s.burst_gap_s} s" if s.arrival == "burst" else
               "all at once" if math.isinf(s.request_rate) else f"Poisson at {s.request_rate:g} req/s")
    lens = (f"input {'%d:%d' % s.input_len_range if s.input_len_range else s.input_len} tokens"
            f" ({'exact' if exact else 'approximate'}), output "
            f"{'%d:%d' % s.output_len_range if s.output_len_range else s.output_len} tokens")
    slo = ", ".join(x for x in (f"TTFT <= {s.slo_ttft_ms:g} ms" if s.slo_ttft_ms is not None else "",
                                f"TPOT <= {s.slo_tpot_ms:g} ms" if s.slo_tpot_ms is not None else "") if x)
    return (f"{n} streamed requests to /v1/{'chat/completions' if s.endpoint == 'chat' else 'completions'} of {url} "
            f"(model {model}); {arrival}; max concurrency {s.max_concurrency or 'unlimited'}; {lens}; "
            f"temperature {s.temperature:g}; ignore_eos {'on' if s.ignore_eos else 'off'}; seed {s.seed}"
            + (f"; SLOs {slo}" if slo else "") + ".")


ROWS = [("successful requests", "completed", "{:d}"), ("failed requests", "failed", "{:d}"),
        ("duration (s)", "duration_s", "{:.2f}"), ("total input tokens", "total_input_tokens", "{:d}"),
        ("total output tokens", "total_output_tokens", "{:d}"),
        ("request throughput (req/s)", "request_throughput", "{:.3f}"),
        ("output token throughput (tok/s)", "output_throughput", "{:.1f}"),
        ("total token throughput (tok/s)", "total_token_throughput", "{:.1f}"),
        ("goodput (req/s)", "goodput", "{:.3f}")]
LATENCIES = [("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")]


def _rows(summary: dict) -> list[tuple[str, float | int | None, str]]:
    rows = [(name, summary.get(key), fmt) for name, key, fmt in ROWS
            if key != "goodput" or summary.get("goodput") is not None]
    for name, key in LATENCIES:
        for stat in ("mean", "median", "p99", "std"):
            rows.append((f"{name} {stat} (ms)", summary[key][stat], "{:.2f}"))
    return rows


def table(targets: list[dict]) -> str:
    """One Markdown table: a column per target, then (with several) a ratio column per target vs the first."""
    labels = [t["label"] for t in targets]
    rows = [_rows(t["summary"]) for t in targets]
    head = ["metric"] + labels + [f"{lb} / {labels[0]}" for lb in labels[1:]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    names = [r[0] for r in rows[0]]
    for k, name in enumerate(names):
        cells = [name]
        values = []
        for rs in rows:
            match = [r for r in rs if r[0] == name]
            v, fmt = (match[0][1], match[0][2]) if match else (None, "")
            values.append(v)
            cells.append("" if v is None else fmt.format(v) if not (fmt == "{:d}" and isinstance(v, float)) else f"{v:g}")
        for v in values[1:]:
            base = values[0]
            cells.append(f"{v / base:.3f}" if isinstance(v, (int, float)) and isinstance(base, (int, float)) and base
                         else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(targets: list[dict]) -> str:
    title = "serve: " + " vs ".join(t["label"] for t in targets)
    lines = [f"# {title}", ""]
    for t in targets:
        lines += [f"- **{t['label']}**: {t['notes']}", ""]
    lines += [table(targets), ""]
    s0 = targets[0]["summary"]
    lines += [f"Latencies in ms over the successful requests (ITL pooled over them); input tokens from "
              f"{s0['input_tokens_from']}, output tokens from {s0['output_tokens_from']}. "
              "TTFT = first content chunk - send; TPOT = (E2E - TTFT) / (output tokens - 1); "
              "ITL = gaps between content chunks; E2E = end of stream - send.", ""]
    for t in targets:
        s = t["summary"]
        if s.get("output_len_mismatch"):
            lines += [f"{t['label']}: {s['output_len_mismatch']} requests returned a different number of output "
                      "tokens than requested (the server may not honour ignore_eos).", ""]
        if s["errors"]:
            lines += [f"{t['label']}: failures (first {len(s['errors'])} kinds):", ""]
            lines += [f"- {e['count']} x `{e['error'][:200]}`" for e in s["errors"]] + [""]
    lines += ["Provenance:", "", "```json", json.dumps(targets[0]["provenance"], indent=2, default=str), "```", ""]
    for t in targets:
        tg = t["target"]
        lines += [f"Server `{t['label']}`: {tg['url']}, /v1/models:", "", "```json",
                  json.dumps(tg.get("v1_models"), indent=2, default=str)[:4000], "```", ""]
    return "\n".join(lines)


def _write(out: Path, name: str, data: dict, md: str) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"{name}.json", out / f"{name}.md"
    json_path.write_text(json.dumps(data, indent=2, default=str))
    md_path.write_text(md)
    return json_path, md_path
