"""`minivllm bench soak`: thousands of mixed, bursty, partly abandoned requests against a
real `minivllm serve`, then proof that the server lost nothing and leaked nothing.

The server is a real `python -m minivllm serve` subprocess (two `cpu:1` workers by
default), or an already-running one (`url=`). The client is one asyncio loop with an
httpx client that keeps no idle connections, so every request has its own TCP
connection and a cancel or a disconnect really closes it.

Workload (all of it drawn from `seed`): prompt bodies cut from the repository's text
(data/prompts.json, data/speculative/*.txt) at a random token offset, 5..300 tokens
(half of them under 60), some starting with one of four shared preambles (prefix-cache
hits), some exact repeats of an earlier prompt, some sprinkled with non-ASCII words (a
streamed token may end mid-character), some sent as token ids; `max_tokens` 1..cap;
temperature 0 / 0.7 / 1.0 with random top_p, top_k, seed, penalties, stop strings and
ignore_eos; /v1/completions and /v1/chat/completions, streamed and not. Arrivals come in
bursts (`burst` requests at once), each followed by a wait until the client has nothing
in flight (`drain_to`) and an idle gap (`gap_s`) during which a Poisson trickle
(`trickle_rate` per second) arrives. With `max_duration_s` no burst or trickle request
starts after that many seconds: the soak then covers the requests sent so far (the
result says how many of the planned ones).

Abandonment: a `cancel_fraction` of the requests are cancelled: the asyncio task doing
the request is cancelled, which closes its connection. A fifth of the cancels come within
30 ms of sending (often before the request is even routed); the rest at a random fraction
(0..1.3) of the recent median end-to-end latency after sending, or, for half of the
streamed ones, at a random fraction of the recent median decode time after the first
chunk (mid-stream). A `disconnect_fraction` of the requests are streamed and close the
stream after a random number of chunks (1..max_tokens). A request that ends before its
cancel or disconnect is simply "finished".

Every request ends exactly once on the client side, as one of:
    finished         200 with finish_reason stop/length (and, streamed, `data: [DONE]`)
    http_error       a non-200 status (status and body kept)
    stream_error     an error chunk inside a 200 stream
    cancelled        the client cancelled it (before or after the first byte)
    disconnected     the client closed the stream mid-way
    transport_error  httpx raised (connect/read error, timeout, reset)
    protocol_error   a malformed answer (a stream without [DONE] or finish_reason, bad JSON)

While it runs, a thread samples the RSS of the server process and of each of its child
processes (the workers) every second (psutil). At the end, once every client is done,
it waits until the server is idle and reads `/v1/cluster/snapshot?fresh=true`: the
request ledger (`requests`) and every worker's engine snapshot. The checks (each one
named in the result):

    no_5xx, no_transport_errors, no_protocol_errors, no_stream_errors, no_unexpected_4xx,
    client_anomalies (finish_reason vs max_tokens/ignore_eos), every_request_ended_once,
    ledger_present, ledger_no_open, ledger_no_duplicate_terminals, ledger_balanced
    (submitted == sum(ended)), ledger_no_errors, workers_ready, workers_no_in_flight,
    engines_idle (no waiting/preempted/running), no_leaked_pages (every page free or
    cached-idle, besides `kv.reserved_pages`, the CUDA graphs' scratch page), no_flights,
    counters_balanced (per worker routed == finished + rejected, engine submitted ==
    finished, routed == ledger submitted), client_vs_server (finished <= server stop+length, server
    abort <= cancelled+disconnected, answered <= submitted <= sent), rss_sampled,
    with `max_rss_growth` rss_growth (last-quarter / first-quarter mean RSS per process),
    and, for a server it started, server_clean_exit (exit code 0 after Ctrl-C, no worker
    process left behind).

Results: benchmarks/results/soak-<tag>-<stamp>.json (provenance, settings, counts,
latency and throughput, RSS summary and a coarse series, checks, the failed requests)
and .md. `run()` returns the result dict; the CLI exits non-zero when a check fails.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from minivllm.bench.common import percentile, provenance

OUTCOMES = ("finished", "http_error", "stream_error", "cancelled", "disconnected", "transport_error", "protocol_error")
DEFAULT_DEVICES = ["cpu:1", "cpu:1"]
REPO_DATA = Path(__file__).resolve().parents[2] / "data"
UNICODE_WORDS = ["café", "naïve", "Zürich", "東京", "日本語", "中文", "Ελληνικά", "русский", "🙂", "🚀", "∑", "→",
                 "ß", "Ångström", "ñandú", "हिन्दी", "한국어", "½", "€", "—"]
STOP_STRINGS = [".", "\n", ",", " the", " and", "!", "?", "\n\n"]
SYSTEM_PROMPTS = ["You are a helpful assistant.", "Answer briefly.", "You are a careful technical writer."]


@dataclass
class SoakSettings:
    requests: int = 2000
    seed: int = 0
    cancel_fraction: float = 0.2
    disconnect_fraction: float = 0.1
    max_new_tokens: int = 48
    min_prompt_tokens: int = 5
    max_prompt_tokens: int = 300
    stream_fraction: float = 0.5
    chat_fraction: float = 0.5
    burst: tuple[int, int] = (10, 60)
    gap_s: tuple[float, float] = (0.5, 3.0)
    trickle_rate: float = 2.0  # requests per second during the idle gaps
    drain_to: int = 0  # after a burst, wait until at most this many client requests are in flight
    max_duration_s: float | None = None  # stop sending (not the soak) after this long; None: send all
    request_timeout_s: float = 900.0
    idle_timeout_s: float = 120.0
    max_rss_growth: float | None = 1.5  # None: report only


# -- the workload ---------------------------------------------------------------------------------


@dataclass
class Plan:
    index: int
    endpoint: str  # "completions" | "chat"
    stream: bool
    action: str  # "normal" | "cancel" | "disconnect"
    body: dict
    target_prompt_tokens: int
    cancel_mode: str | None = None  # "early": within 30 ms; "timed": a fraction of the recent median e2e
    # latency after sending; "mid_stream": a fraction of the recent median decode time after the first chunk
    cancel_after_s: float | None = None  # the early cancels' delay
    cancel_at_fraction: float | None = None
    disconnect_after_chunks: int | None = None


@dataclass
class Record:
    index: int
    endpoint: str
    stream: bool
    action: str
    max_tokens: int
    ignore_eos: bool
    has_stop: bool
    outcome: str | None = None
    endings: int = 0
    status: int | None = None
    error: str | None = None
    request_id: str | None = None
    worker: str | None = None
    finish_reason: str | None = None
    chunks: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    got_done: bool = False
    cancel_phase: str | None = None  # where a cancel landed: before_headers, before_first_chunk, mid_stream
    cancel_after_s: float | None = None
    t_start: float = 0.0
    t_headers: float | None = None
    t_first: float | None = None
    t_end: float | None = None

    def end(self, outcome: str, error: str | None = None, t: float | None = None) -> None:
        self.endings += 1
        if self.outcome is None:
            self.outcome, self.error = outcome, error
            self.t_end = time.perf_counter() if t is None else t


def _corpus_text(seed: int) -> str:
    pieces = []
    try:
        pieces += list(json.loads((REPO_DATA / "prompts.json").read_text())["prompts"])
    except (OSError, ValueError, KeyError):
        pass
    for name in ("creative_writing.txt", "code_refactor.txt"):
        try:
            pieces += [p for p in (REPO_DATA / "speculative" / name).read_text().split("\n\n") if p.strip()]
        except OSError:
            pass
    if not pieces:
        pieces = ["The quick brown fox jumps over the lazy dog while the engine schedules another batch."]
    rng = random.Random(seed)
    out = []
    for _ in range(4):  # a few shuffles: a corpus long enough for random 300-token cuts
        order = pieces[:]
        rng.shuffle(order)
        out += order
    return "\n\n".join(out)


class PromptMaker:
    """Prompt texts of about `n` tokens, cut from the corpus at a random token offset.
    Without a tokenizer (a remote server whose model is not here) words stand in for tokens."""

    def __init__(self, tokenizer, seed: int):
        self.tok = tokenizer
        text = _corpus_text(seed)
        if tokenizer is not None:
            self.ids = tokenizer.encode(text, add_bos=False, parse_special=False)
        else:
            self.ids = None
            self.words = text.split()

    def cut(self, rng: random.Random, n: int) -> tuple[str, list[int] | None]:
        if self.ids is not None:
            start = rng.randrange(0, max(1, len(self.ids) - n))
            ids = self.ids[start:start + n]
            return self.tok.decode(ids), ids
        start = rng.randrange(0, max(1, len(self.words) - n))
        return " ".join(self.words[start:start + max(1, int(n * 0.75))]), None

    def count(self, text: str) -> int:
        if self.tok is None:
            return max(1, int(len(text.split()) / 0.75))
        return len(self.tok.encode(text, add_bos=False, parse_special=False))


def make_plans(settings: SoakSettings, maker: PromptMaker, model_name: str | None) -> list[Plan]:
    s = settings
    rng = random.Random(s.seed)
    preambles = []
    for i in range(4):
        text, _ = maker.cut(random.Random(1000 + s.seed * 7 + i), 32 + 24 * i)
        preambles.append(text)
    previous: list[str] = []
    plans = []
    for i in range(s.requests):
        r = rng.random()
        action = "cancel" if r < s.cancel_fraction else "disconnect" if r < s.cancel_fraction + s.disconnect_fraction else "normal"
        chat = rng.random() < s.chat_fraction
        stream = True if action == "disconnect" else rng.random() < s.stream_fraction
        lo, hi = s.min_prompt_tokens, max(s.min_prompt_tokens, s.max_prompt_tokens)
        target = rng.randint(lo, min(hi, max(lo, 60))) if rng.random() < 0.5 else rng.randint(min(hi, max(lo, 60)), hi)
        token_ids = None
        kind = rng.random()
        if previous and kind < 0.05:
            text = rng.choice(previous)  # an exact repeat
        elif kind < 0.30 and target > 40:
            pre = rng.choice(preambles)
            rest = max(1, target - maker.count(pre))
            text = pre + " " + maker.cut(rng, rest)[0]
        else:
            text, token_ids = maker.cut(rng, target)
            if rng.random() < 0.1:
                words = text.split(" ")
                for _ in range(rng.randint(1, 4)):
                    words.insert(rng.randrange(len(words) + 1), rng.choice(UNICODE_WORDS))
                text, token_ids = " ".join(words), None
        if not text.strip():
            text, token_ids = "Hello there, tell me a story.", None
        previous.append(text)
        if len(previous) > 50:
            previous.pop(0)

        max_tokens = rng.randint(1, s.max_new_tokens)
        temperature = rng.choice([0.0, 0.7, 1.0])
        body: dict = {"max_tokens": max_tokens, "temperature": temperature}
        if temperature > 0:
            if rng.random() < 0.5:
                body["top_p"] = rng.choice([0.5, 0.8, 0.9, 0.95])
            if rng.random() < 0.5:
                body["top_k"] = rng.choice([1, 5, 20, 50])
            if rng.random() < 0.5:
                body["seed"] = rng.randrange(1 << 31)
            if rng.random() < 0.1:
                body["min_p"] = 0.05
        if rng.random() < 0.1:
            body["repetition_penalty"] = 1.1
        if rng.random() < 0.1:
            body["frequency_penalty"] = 0.5
        if rng.random() < 0.1:
            body["presence_penalty"] = 0.5
        if rng.random() < 0.2:
            body["stop"] = rng.choice(STOP_STRINGS) if rng.random() < 0.5 else rng.sample(STOP_STRINGS, 2)
        if rng.random() < 0.3:
            body["ignore_eos"] = True
        if model_name and rng.random() < 0.5:
            body["model"] = model_name
        if stream:
            body["stream"] = True
            if rng.random() < 0.7:
                body["stream_options"] = {"include_usage": True}
        if chat:
            messages = []
            if rng.random() < 0.3:
                messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
            if rng.random() < 0.15:
                messages += [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello! How can I help?"}]
            messages.append({"role": "user", "content": text})
            body["messages"] = messages
            if rng.random() < 0.2:
                body["max_completion_tokens"] = body.pop("max_tokens")
        else:
            body["prompt"] = token_ids if token_ids and rng.random() < 0.1 else text
        plan = Plan(i, "chat" if chat else "completions", stream, action, body, target)
        if action == "cancel":
            u = rng.random()
            plan.cancel_mode = "early" if u < 0.2 else "mid_stream" if stream and u < 0.6 else "timed"
            if plan.cancel_mode == "early":
                plan.cancel_after_s = rng.uniform(0.0, 0.03)
            else:
                plan.cancel_at_fraction = rng.uniform(0.0, 1.3 if plan.cancel_mode == "timed" else 1.0)
        elif action == "disconnect":
            plan.disconnect_after_chunks = rng.randint(1, max(1, max_tokens))
        plans.append(plan)
    return plans


def make_schedule(settings: SoakSettings, n: int) -> list[tuple]:
    """[("burst", size) | ("gap", seconds, [trickle offsets])...] covering n requests."""
    rng = random.Random(settings.seed + 1)
    out, left = [], n
    while left > 0:
        size = min(left, rng.randint(*settings.burst))
        out.append(("burst", size))
        left -= size
        if left <= 0:
            break
        gap = rng.uniform(*settings.gap_s)
        offsets, t = [], 0.0
        while settings.trickle_rate > 0 and left > 0:
            t += rng.expovariate(settings.trickle_rate)
            if t >= gap:
                break
            offsets.append(t)
            left -= 1
        out.append(("gap", gap, offsets))
    return out


# -- the client -----------------------------------------------------------------------------------


def _first_choice(obj: dict) -> dict | None:
    choices = obj.get("choices") or []
    return choices[0] if choices else None


async def _exchange(client, plan: Plan, rec: Record, first_chunk: asyncio.Event | None = None) -> None:
    import httpx

    path = "/v1/chat/completions" if plan.endpoint == "chat" else "/v1/completions"
    try:
        if not plan.stream:
            r = await client.post(path, json=plan.body)
            rec.t_headers = rec.t_first = time.perf_counter()
            rec.status = r.status_code
            if r.status_code != 200:
                rec.end("http_error", r.text[:500])
                return
            try:
                data = r.json()
                choice = _first_choice(data)
                rec.request_id = data.get("id")
                rec.worker = (data.get("minivllm") or {}).get("worker")
                rec.finish_reason = choice.get("finish_reason") if choice else None
                u = data.get("usage") or {}
                rec.prompt_tokens, rec.completion_tokens = u.get("prompt_tokens"), u.get("completion_tokens")
            except (ValueError, AttributeError) as exc:
                rec.end("protocol_error", f"bad JSON body: {exc}: {r.text[:200]}")
                return
            if rec.finish_reason in ("stop", "length"):
                rec.end("finished")
            else:
                rec.end("protocol_error", f"finish_reason {rec.finish_reason!r}: {r.text[:300]}")
            return

        async with client.stream("POST", path, json=plan.body) as r:
            rec.t_headers = time.perf_counter()
            rec.status = r.status_code
            if r.status_code != 200:
                body = (await r.aread()).decode(errors="replace")
                rec.end("http_error", body[:500])
                return
            async for line in r.aiter_lines():
                if not line or line.startswith(":"):
                    continue
                if not line.startswith("data: "):
                    rec.end("protocol_error", f"not an SSE data line: {line[:200]!r}")
                    return
                payload = line[6:]
                if payload == "[DONE]":
                    rec.got_done = True
                    break
                try:
                    obj = json.loads(payload)
                except ValueError:
                    rec.end("protocol_error", f"bad JSON chunk: {payload[:200]!r}")
                    return
                if "error" in obj:
                    rec.end("stream_error", json.dumps(obj["error"])[:500])
                    return
                rec.chunks += 1
                if rec.t_first is None:
                    rec.t_first = time.perf_counter()
                    if first_chunk is not None:
                        first_chunk.set()
                rec.request_id = rec.request_id or obj.get("id")
                choice = _first_choice(obj)
                if choice and choice.get("finish_reason"):
                    rec.finish_reason = choice["finish_reason"]
                if obj.get("minivllm"):
                    rec.worker = obj["minivllm"].get("worker") or rec.worker
                if obj.get("usage"):
                    rec.prompt_tokens = obj["usage"].get("prompt_tokens")
                    rec.completion_tokens = obj["usage"].get("completion_tokens")
                if plan.action == "disconnect" and rec.chunks >= (plan.disconnect_after_chunks or 1):
                    rec.end("disconnected")
                    return  # leaving `async with` closes the response and its connection
            if not rec.got_done:
                rec.end("protocol_error", f"stream ended without [DONE] after {rec.chunks} chunks")
            elif rec.finish_reason not in ("stop", "length"):
                rec.end("protocol_error", f"stream ended with finish_reason {rec.finish_reason!r}")
            else:
                rec.end("finished")
    except httpx.HTTPError as exc:
        rec.end("transport_error", f"{type(exc).__name__}: {exc}"[:500])


async def _one(client, plan: Plan, rec: Record, typical_e2e_s: float, typical_decode_s: float) -> None:
    rec.t_start = time.perf_counter()
    try:
        if plan.action != "cancel":
            await _exchange(client, plan, rec)
        else:
            first = asyncio.Event()
            task = asyncio.create_task(_exchange(client, plan, rec, first))
            if plan.cancel_mode == "early":
                delay = plan.cancel_after_s
            elif plan.cancel_mode == "timed":
                delay = plan.cancel_at_fraction * typical_e2e_s
            else:  # mid_stream: wait for the first chunk (or the end), then a while
                waiter = asyncio.create_task(first.wait())
                await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                delay = plan.cancel_at_fraction * typical_decode_s
            rec.cancel_after_s = delay
            done, _ = await asyncio.wait({task}, timeout=delay)
            if not done and task.cancel():
                t = time.perf_counter()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                if rec.outcome is None:
                    rec.cancel_phase = ("before_headers" if rec.t_headers is None else
                                        "before_first_chunk" if rec.chunks == 0 else "mid_stream")
                    rec.end("cancelled", t=t)
            else:
                await task  # finished before its cancel: re-raises a client bug, if any
    except Exception as exc:  # noqa: BLE001 - a bug in this client must still end the request once
        rec.end("protocol_error", f"client error: {exc!r}"[:500])
    if rec.outcome is None:
        rec.end("protocol_error", "client bug: the request ended without an outcome")


async def drive(url: str, plans: list[Plan], schedule: list[tuple], settings: SoakSettings, *,
                api_key: str | None = None, progress: bool = True) -> tuple[list[Record], float, float]:
    """Send the plans per the schedule (all of them, or those launched before `settings.max_duration_s`);
    returns (records of the sent ones, t_first_send, t_last_end) in perf_counter time."""
    import httpx

    records = [Record(p.index, p.endpoint, p.stream, p.action,
                      int(p.body.get("max_tokens") or p.body.get("max_completion_tokens") or 0),
                      bool(p.body.get("ignore_eos")), bool(p.body.get("stop"))) for p in plans]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # No keep-alive: every request has its own connection, so a cancel or a disconnect closes it.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    timeout = httpx.Timeout(settings.request_timeout_s, connect=60.0)
    in_flight: set[asyncio.Task] = set()
    done_count = launched = 0
    next_report = max(1, len(plans) // 10)
    t_origin = time.perf_counter()

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout, headers=headers) as client:
        cursor = iter(zip(plans, records))

        def launch() -> None:
            nonlocal launched
            plan, rec = next(cursor)
            launched += 1
            # Cancels land at a fraction of the recent median latency, so they hit queued,
            # prefilling and decoding requests alike whatever the load does to latency.
            window = [r for r in records[max(0, plan.index - 200):plan.index] if r.outcome == "finished"][-50:]
            e2e = [r.t_end - r.t_start for r in window]
            decode = [r.t_end - r.t_first for r in window if r.stream and r.t_first is not None]
            task = asyncio.create_task(_one(client, plan, rec, statistics.median(e2e) if len(e2e) >= 5 else 2.0,
                                            statistics.median(decode) if len(decode) >= 5 else 1.0))
            in_flight.add(task)

            def finished(t: asyncio.Task) -> None:
                nonlocal done_count, next_report
                in_flight.discard(t)
                done_count += 1
                if progress and done_count >= next_report:
                    counts = Counter(r.outcome for r in records if r.outcome)
                    print(f"soak: {done_count}/{len(plans)} done after {time.perf_counter() - t_origin:.0f} s: "
                          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), flush=True)
                    next_report += max(1, len(plans) // 10)

            task.add_done_callback(finished)

        deadline = t_origin + settings.max_duration_s if settings.max_duration_s else math.inf
        for phase in schedule:
            if time.perf_counter() > deadline:
                break
            if phase[0] == "burst":
                for _ in range(phase[1]):
                    launch()
                while len(in_flight) > settings.drain_to:
                    await asyncio.sleep(0.05)
            else:
                _, gap, offsets = phase
                t0 = time.perf_counter()
                for off in offsets:
                    await asyncio.sleep(max(0.0, t0 + off - time.perf_counter()))
                    if time.perf_counter() > deadline:
                        break
                    launch()
                await asyncio.sleep(max(0.0, t0 + gap - time.perf_counter()))
        while in_flight:
            await asyncio.wait(set(in_flight))
    if launched < len(records) and progress:
        print(f"soak: max_duration_s={settings.max_duration_s}: sent {launched} of {len(records)} requests", flush=True)
    records = records[:launched]
    t_end = max((r.t_end or t_origin) for r in records) if records else t_origin
    return records, t_origin, t_end


# -- the server -----------------------------------------------------------------------------------


def serve_supports(flag: str) -> bool:
    out = subprocess.run([sys.executable, "-m", "minivllm", "serve", "--help"], capture_output=True, text=True,
                         timeout=300)
    return flag in out.stdout


class ServerProcess:
    """`python -m minivllm serve ...` as a subprocess; its output goes to a log file."""

    def __init__(self, args: list[str], port: int, log_path: Path):
        self.args, self.port, self.log_path = args, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self._log = None
        self.worker_pids: dict[int, str] = {}
        self.orphans: list[str] = []  # children still alive after the server exited (then killed)

    def start(self, timeout_s: float, api_key: str | None = None) -> "ServerProcess":
        import httpx

        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.env())
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} during start-up:\n{self.log_tail()}")
            try:
                if self.is_ready(httpx):
                    return self
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{self.name} was not healthy within {timeout_s} s:\n{self.log_tail()}")
            time.sleep(0.5)

    # A peer server (minivllm/bench/llama_cpp_server.py) overrides these and `name`.
    name = "minivllm serve"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "minivllm", "serve", *self.args]

    def env(self) -> dict | None:
        return None  # inherit ours

    def is_ready(self, httpx) -> bool:
        r = httpx.get(self.url + "/health", timeout=5)
        if r.status_code == 200 and r.json().get("status") == "ok":
            self.worker_pids = {w["pid"]: w["name"] for w in r.json()["workers"] if w.get("pid")}
            return True
        return False

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """Ctrl-C (uvicorn shuts down, the cluster stops its workers), then SIGTERM, then SIGKILL;
        any worker of ours still alive afterwards is killed by pid."""
        if self.proc is None:
            return None
        children = []
        try:
            import psutil

            children = psutil.Process(self.proc.pid).children(recursive=True)
        except Exception:  # noqa: BLE001 - psutil missing or the process already gone
            pass
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(10)
        for child in children:
            try:
                child.wait(10)
            except Exception:  # noqa: BLE001 - still alive 10 s after its parent left: ours to kill
                self.orphans.append(f"{child.pid}")
                try:
                    child.kill()
                except Exception:  # noqa: BLE001
                    pass
        if self._log is not None:
            self._log.close()
        return self.proc.returncode


# -- memory sampling ------------------------------------------------------------------------------


class RssSampler:
    """RSS of the server process and each of its children, every `interval_s`, on a thread."""

    def __init__(self, server_pid: int | None, worker_pids: dict[int, str], interval_s: float = 1.0):
        self.server_pid, self.worker_pids, self.interval_s = server_pid, dict(worker_pids), interval_s
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-rss", daemon=True)
        self.error: str | None = None

    def label(self, proc) -> str:
        if proc.pid == self.server_pid:
            return "server"
        if proc.pid in self.worker_pids:
            return f"worker {self.worker_pids[proc.pid]}"
        try:
            name = proc.name()
        except Exception:  # noqa: BLE001
            name = "?"
        return f"child {name} ({proc.pid})"

    def sample(self) -> None:
        import psutil

        procs = []
        if self.server_pid is not None:
            try:
                root = psutil.Process(self.server_pid)
                procs = [root] + root.children(recursive=True)
            except psutil.Error:
                procs = []
        else:
            for pid in self.worker_pids:
                try:
                    procs.append(psutil.Process(pid))
                except psutil.Error:
                    pass
        row = {}
        for p in procs:
            try:
                row[self.label(p)] = p.memory_info().rss
            except psutil.Error:
                pass
        self.samples.append((time.perf_counter(), row))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except Exception as exc:  # noqa: BLE001 - report, do not kill the soak
                self.error = repr(exc)
            self._stop.wait(self.interval_s)

    def start(self) -> "RssSampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def summary(self, t0: float, t1: float) -> dict:
        """Per process: mean RSS of the first and of the last quarter of [t0, t1], delta, ratio, max."""
        quarter = (t1 - t0) / 4
        window = [(t, row) for t, row in self.samples if t0 <= t <= t1]
        names = sorted({n for _, row in window for n in row})
        out = {}
        for name in names:
            series = [(t, row[name]) for t, row in window if name in row]
            first = [v for t, v in series if t <= t0 + quarter]
            last = [v for t, v in series if t >= t1 - quarter]
            f = statistics.fmean(first) if first else math.nan
            la = statistics.fmean(last) if last else math.nan
            out[name] = {"samples": len(series), "first_quarter_mb": f / 2**20, "last_quarter_mb": la / 2**20,
                         "delta_mb": (la - f) / 2**20, "ratio": la / f if f and f == f else math.nan,
                         "max_mb": max(v for _, v in series) / 2**20}
        return out

    def series(self, t0: float, every_s: float = 10.0) -> dict[str, list]:
        """A coarse series for the result file: [[seconds since t0, MB], ...] per process."""
        out: dict[str, list] = {}
        last: dict[str, float] = {}
        for t, row in self.samples:
            for name, v in row.items():
                if name not in last or t - last[name] >= every_s:
                    out.setdefault(name, []).append([round(t - t0, 1), round(v / 2**20, 1)])
                    last[name] = t
        return out


# -- the checks -----------------------------------------------------------------------------------


def _get_snapshot(url: str, headers: dict) -> dict:
    import httpx

    r = httpx.get(url + "/v1/cluster/snapshot", params={"fresh": "true"}, headers=headers, timeout=60)
    r.raise_for_status()
    return r.json()


def server_idle(snap: dict) -> bool:
    req = snap.get("requests") or {}
    if req.get("open", 0):
        return False
    for w in snap.get("workers", []):
        if w.get("in_flight"):
            return False
        s = w.get("snapshot") or {}
        q, kv = s.get("queues") or {}, s.get("kv") or {}
        if q.get("waiting") or q.get("running") or q.get("preempted"):
            return False
        # reserved_pages: the engine's own (the CUDA graphs' scratch page), never a request's
        if kv and kv.get("available_pages", 0) + kv.get("reserved_pages", 0) != kv.get("total_pages"):
            return False
    return True


def wait_idle(url: str, headers: dict, timeout_s: float) -> tuple[dict, float]:
    """The fresh cluster snapshot once the server is idle (or the last one at the timeout), and the wait."""
    t0 = time.monotonic()
    while True:
        snap = _get_snapshot(url, headers)
        if server_idle(snap) or time.monotonic() - t0 > timeout_s:
            return snap, time.monotonic() - t0
        time.sleep(0.5)


def _ended(ledger: dict | None) -> Counter:
    return Counter((ledger or {}).get("ended") or {})


def evaluate(records: list[Record], start: dict, final: dict, rss: dict, settings: SoakSettings,
             idle_wait_s: float, expect_server_rss: bool = True) -> list[dict]:
    checks: list[dict] = []

    def check(name: str, ok: bool, detail: str = "") -> None:
        checks.append({"name": name, "ok": bool(ok), "detail": detail})

    by = Counter(r.outcome for r in records)
    http = [r for r in records if r.outcome == "http_error"]
    fivexx = [r for r in http if (r.status or 0) >= 500]
    four = [r for r in http if 400 <= (r.status or 0) < 500 and r.status != 429]
    check("no_5xx", not fivexx, f"{len(fivexx)} responses >= 500" + (f"; first: {fivexx[0].status} {fivexx[0].error}" if fivexx else ""))
    for name, outcome in (("no_transport_errors", "transport_error"), ("no_protocol_errors", "protocol_error"),
                          ("no_stream_errors", "stream_error")):
        bad = [r for r in records if r.outcome == outcome]
        check(name, not bad, f"{len(bad)}" + (f"; first (#{bad[0].index}): {bad[0].error}" if bad else ""))
    check("no_unexpected_4xx", not four, f"{len(four)} (429s: {sum(r.status == 429 for r in http)})"
          + (f"; first: {four[0].status} {four[0].error}" if four else ""))
    anomalies = []
    for r in records:
        if r.outcome != "finished" or r.completion_tokens is None:
            continue
        if r.completion_tokens > r.max_tokens:
            anomalies.append(f"#{r.index}: {r.completion_tokens} tokens > max_tokens {r.max_tokens}")
        elif r.finish_reason == "length" and r.completion_tokens != r.max_tokens:
            anomalies.append(f"#{r.index}: length after {r.completion_tokens} of {r.max_tokens} tokens")
        elif r.ignore_eos and not r.has_stop and r.finish_reason != "length":
            anomalies.append(f"#{r.index}: ignore_eos without stop strings ended {r.finish_reason!r}")
    check("client_anomalies", not anomalies, f"{len(anomalies)}" + (f"; {anomalies[:3]}" if anomalies else ""))
    once = [r for r in records if r.endings != 1 or r.outcome not in OUTCOMES]
    check("every_request_ended_once", not once and len(records) == len({r.index for r in records}),
          f"{len(records)} requests sent (of {settings.requests} planned), {len(once)} not ended exactly once")

    ledger, ledger0 = final.get("requests"), start.get("requests") or {}
    check("ledger_present", ledger is not None, "" if ledger else "the snapshot has no 'requests' ledger")
    ledger = ledger or {}
    ended = _ended(ledger) - _ended(ledger0)
    submitted = ledger.get("submitted", 0) - ledger0.get("submitted", 0)
    check("ledger_no_open", ledger.get("open") == 0, f"open={ledger.get('open')} ids={ledger.get('open_ids')} "
          f"(idle wait {idle_wait_s:.1f} s)")
    check("ledger_no_duplicate_terminals", ledger.get("duplicate_terminals") == 0,
          f"duplicate_terminals={ledger.get('duplicate_terminals')}")
    check("ledger_balanced", ledger.get("submitted") == sum(_ended(ledger).values()),
          f"submitted={ledger.get('submitted')} sum(ended)={sum(_ended(ledger).values())} ended={dict(_ended(ledger))}")
    check("ledger_no_errors", ended.get("error", 0) == 0, f"ended error={ended.get('error', 0)}")

    workers = final.get("workers") or []
    not_ready = [w["name"] for w in workers if w.get("state") != "ready"]
    check("workers_ready", workers and not not_ready, f"{len(workers)} workers; not ready: {not_ready}")
    busy = {w["name"]: [f["request_id"] for f in w.get("in_flight") or []] for w in workers if w.get("in_flight")}
    check("workers_no_in_flight", not busy, f"{busy}" if busy else "")
    queues, pages, flights = {}, {}, {}
    for w in workers:
        s = w.get("snapshot") or {}
        q = s.get("queues") or {}
        left = {k: [x.get("id") for x in q.get(k) or []] for k in ("waiting", "preempted", "running") if q.get(k)}
        if left or not s:
            queues[w["name"]] = left or "no engine snapshot"
        kv = s.get("kv") or {}
        states = Counter(kv.get("page_states") or [])
        held = {k: v for k, v in states.items() if k not in ("free", "cached-idle")}
        reserved = kv.get("reserved_pages", 0)  # the CUDA graphs' scratch page: owned by the engine itself
        if not states:
            pages[w["name"]] = "no page states"
        elif sum(held.values()) > reserved or set(held) - {"owned"}:
            pages[w["name"]] = f"{held} (reserved_pages {reserved})"
        pc = s.get("prefix_cache") or {}
        if pc.get("flights"):
            flights[w["name"]] = pc["flights"]
    check("engines_idle", not queues, f"{queues}" if queues else "")
    check("no_leaked_pages", not pages, f"{pages}" if pages else
          "every page free or cached-idle (besides the engine's reserved pages)")
    check("no_flights", not flights, f"{flights}" if flights else "")
    unbalanced = {}
    for w in workers:
        c = w.get("counters") or {}
        e = (w.get("snapshot") or {}).get("counters") or {}
        if c.get("routed") != c.get("finished", 0) + c.get("rejected", 0):
            unbalanced[w["name"]] = f"routed {c.get('routed')} != finished {c.get('finished')} + rejected {c.get('rejected')}"
        elif e.get("requests_submitted") != e.get("requests_finished"):
            unbalanced[w["name"]] = (f"engine requests_submitted {e.get('requests_submitted')} != "
                                     f"requests_finished {e.get('requests_finished')}")
    routed = sum((w.get("counters") or {}).get("routed", 0) for w in workers) - \
        sum((w.get("counters") or {}).get("routed", 0) for w in start.get("workers") or [])
    if ledger and routed != submitted:
        unbalanced["cluster"] = f"workers routed {routed} != ledger submitted {submitted}"
    check("counters_balanced", not unbalanced, f"{unbalanced}" if unbalanced else
          f"per worker routed == finished + rejected, engine submitted == finished; routed {routed}")

    finished = by.get("finished", 0)
    answered = sum(1 for r in records if r.status == 200)  # the server routed these
    sent = len(records)
    abandoned = by.get("cancelled", 0) + by.get("disconnected", 0)
    server_done = ended.get("stop", 0) + ended.get("length", 0)
    problems = []
    if finished > server_done:
        problems.append(f"client finished {finished} > server stop+length {server_done}")
    if ended.get("abort", 0) > abandoned:
        problems.append(f"server abort {ended.get('abort', 0)} > client cancelled+disconnected {abandoned}")
    if not answered <= submitted <= sent:
        problems.append(f"not answered {answered} <= server submitted {submitted} <= sent {sent}")
    check("client_vs_server", not problems,
          "; ".join(problems) or f"finished {finished} <= stop+length {server_done}; abort {ended.get('abort', 0)} <= "
          f"cancelled+disconnected {abandoned}; answered {answered} <= submitted {submitted} <= sent {sent}")

    unsampled = {k: v["samples"] for k, v in rss.items() if v["samples"] < 2}
    expected = int(expect_server_rss) + len(workers)
    check("rss_sampled", len(rss) >= expected and not unsampled,
          f"{len(rss)} processes sampled (expected >= {expected}); too few samples: {unsampled}")
    if settings.max_rss_growth is not None:
        grown = {k: round(v["ratio"], 3) for k, v in rss.items()
                 if (k == "server" or k.startswith("worker")) and v["ratio"] > settings.max_rss_growth}
        check("rss_growth", not grown, f"last/first-quarter RSS over {settings.max_rss_growth}: {grown}" if grown
              else f"every ratio <= {settings.max_rss_growth}")
    return checks


# -- the whole run --------------------------------------------------------------------------------


def device_tag(devices: list[str]) -> str:
    """["cpu:1", "cpu:1"] -> "cpu-2x1"; other mixes joined with '+'."""
    c = Counter(devices)
    if len(c) == 1:
        d = devices[0]
        kind, _, n = d.partition(":")
        return f"{kind}-{len(devices)}x{n}" if n else f"{kind}-{len(devices)}x"
    return "+".join(d.replace(":", "") for d in devices)


def _write(result: dict, out_dir: Path, name: str) -> tuple[Path, Path]:
    import datetime as _dt

    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    json_path, md_path = out_dir / f"{name}-{stamp}.json", out_dir / f"{name}-{stamp}.md"
    json_path.write_text(json.dumps(result, indent=2, default=str))
    md_path.write_text(markdown(result))
    return json_path, md_path


def _f(v, digits: int = 3) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return "nan" if v != v else f"{v:.{digits}g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def markdown(result: dict) -> str:
    s = result["summary"]
    lines = [f"# {result['benchmark']}", "", result.get("notes", ""), "",
             f"**{'PASS' if result['ok'] else 'FAIL'}**: {sum(c['ok'] for c in result['checks'])}/"
             f"{len(result['checks'])} checks pass. {s['requests']} requests"
             + (f" (of {s['requests_planned']} planned: sending stopped at max_duration_s)"
                if s["requests"] < s["requests_planned"] else "") + f" in {s['load_s']:.0f} s "
             f"({s['requests_per_s']:.2f} req/s)" + (f"; server start {s['server_start_s']} s." if s["server_start_s"] else "."), "",
             "## How the requests ended (client side)", "", "| ending | count | streamed | chat |", "|---|---|---|---|"]
    for k in OUTCOMES:
        c = result["client"]["by_outcome"].get(k, 0)
        st = result["client"]["by_outcome_streamed"].get(k, 0)
        ch = result["client"]["by_outcome_chat"].get(k, 0)
        lines.append(f"| {k} | {c} | {st} | {ch} |")
    lines += ["", "Planned actions: " + ", ".join(f"{k} {v}" for k, v in sorted(result["client"]["by_action"].items()))
              + "; how they ended: " + json.dumps(result["client"]["action_x_outcome"]), "",
              "Cancel landed: " + json.dumps(result["client"]["cancel_phase"]), "",
              "## Server ledger (delta over the run)", "",
              "| submitted | " + " | ".join(sorted(result["server"]["ended"])) + " | open | duplicate_terminals |",
              "|---" * (3 + len(result["server"]["ended"])) + "|",
              f"| {result['server']['submitted']} | " + " | ".join(str(v) for _, v in sorted(result["server"]["ended"].items()))
              + f" | {result['server']['open']} | {result['server']['duplicate_terminals']} |", "",
              "| worker | state | routed | stop | length | abort | error | prefill tokens | decode tokens | preemptions "
              "| pages (final) | prefix hits / lookups | evicted pages |", "|---" * 13 + "|"]
    for name, w in result["server"]["per_worker"].items():
        e, c, pc = w.get("engine_counters") or {}, w.get("counters") or {}, w.get("prefix_cache") or {}
        lines.append(f"| {name} | {w.get('state')} | {c.get('routed')} | {e.get('finished_stop')} | "
                     f"{e.get('finished_length')} | {e.get('finished_abort')} | {e.get('finished_error')} | "
                     f"{e.get('prefill_tokens')} | {e.get('decode_tokens')} | {e.get('preemptions')} | "
                     f"{', '.join(f'{k} {v}' for k, v in sorted(w.get('page_states', {}).items()))} of "
                     f"{w.get('total_pages')} | {pc.get('hits')} / {pc.get('lookups')} | {pc.get('evicted_pages')} |")
    lines += ["", "(Worker and engine counters are totals since the workers started.)", "",
              "## Latency and throughput (finished requests)", "", "| measure | value |", "|---|---|"]
    for k, v in s.items():
        if k not in ("requests",):
            lines.append(f"| {k} | {_f(v, 4)} |")
    lines += ["", "## RSS (MB): first vs last quarter of the load", "",
              "| process | samples | first quarter | last quarter | delta | ratio | max |", "|---|---|---|---|---|---|---|"]
    for name, r in result["rss"].items():
        lines.append(f"| {name} | {r['samples']} | {_f(r['first_quarter_mb'], 4)} | {_f(r['last_quarter_mb'], 4)} | "
                     f"{_f(r['delta_mb'], 3)} | {_f(r['ratio'], 4)} | {_f(r['max_mb'], 4)} |")
    lines += ["", "## Checks", "", "| check | ok | detail |", "|---|---|---|"]
    for c in result["checks"]:
        lines.append(f"| {c['name']} | {'yes' if c['ok'] else '**NO**'} | {c['detail'].replace('|', '/')[:300]} |")
    if result.get("failures"):
        lines += ["", "## Failed requests (first 20)", "", "```json",
                  json.dumps(result["failures"][:20], indent=1, default=str)[:8000], "```"]
    lines += ["", "Provenance:", "", "```json", json.dumps(result["provenance"], indent=2, default=str), "```", ""]
    return "\n".join(lines)


def run(model: str = "smollm2-135m", devices: list[str] | None = None, *, url: str | None = None,
        settings: SoakSettings | None = None, max_model_len: int | None = 1024, page_size: int | None = None,
        max_active_requests: int = 8, router: str | None = None, api_key: str | None = None,
        serve_args: list[str] | None = None, out_dir: str | Path | None = None, tag: str | None = None,
        ready_timeout_s: float = 900.0, progress: bool = True, write: bool = True) -> dict:
    """Start the server (unless `url`), drive the soak, check, write the result files; returns the result
    (`result["ok"]`, `result["checks"]`, ...)."""
    import httpx

    from minivllm.bench.results import RESULTS_DIR

    settings = settings or SoakSettings()
    devices_given = bool(devices)
    devices = list(devices or DEFAULT_DEVICES)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    t_wall = time.perf_counter()
    server = None
    log_dir = None
    serve_cmd = None
    start_s = None
    model_path = None
    try:
        from minivllm.models import resolve_model

        model_path = resolve_model(model, progress=False)
    except Exception as exc:  # noqa: BLE001 - a remote server's model need not be here
        if url is None:
            raise
        print(f"soak: model {model!r} is not available here ({exc}); prompts sized by words", flush=True)

    if url is None:
        from minivllm.serving.http_server import free_port

        port = free_port()
        serve_cmd = ["--model", str(model), "--port", str(port), "--max-active-requests", str(max_active_requests)]
        for d in devices:
            serve_cmd += ["--inference-device", d]
        if max_model_len:
            serve_cmd += ["--max-model-len", str(max_model_len)]
        if page_size:
            serve_cmd += ["--page-size", str(page_size)]
        if router:
            serve_cmd += ["--router", router]
        if api_key:
            serve_cmd += ["--api-key", api_key]
        if serve_supports("--max-concurrent-requests"):
            serve_cmd += ["--max-concurrent-requests", "512"]
        serve_cmd += list(serve_args or [])
        if progress:
            print("soak: starting minivllm serve " + " ".join(serve_cmd), flush=True)
        t = time.perf_counter()
        log_dir = tempfile.mkdtemp(prefix="minivllm-soak-")
        server = ServerProcess(serve_cmd, port, Path(log_dir) / "serve.log").start(ready_timeout_s)
        start_s = round(time.perf_counter() - t, 1)
        url = server.url
        worker_pids, server_pid = server.worker_pids, server.proc.pid
    else:
        url = url.rstrip("/")
        h = httpx.get(url + "/health", timeout=30).json()
        worker_pids = {w["pid"]: w["name"] for w in h.get("workers", []) if w.get("pid")}
        server_pid = None
        try:  # a local server: the workers' parent
            import psutil

            parents = {psutil.Process(pid).ppid() for pid in worker_pids}
            server_pid = parents.pop() if len(parents) == 1 else None
        except Exception:  # noqa: BLE001
            pass

    sampler = None
    try:
        models = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()
        served = models["data"][0]["id"]
        tokenizer = None
        if model_path is not None:
            from minivllm.gguf.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_gguf(model_path)
        start_snap = _get_snapshot(url, headers)
        if server is None and not devices_given:
            devices = [f"{w['device']}:{w['threads']}" if w.get("threads") and str(w.get("device")).startswith("cpu")
                       else str(w.get("device")) for w in start_snap.get("workers") or []] or devices
        limit = (start_snap["workers"][0]["snapshot"] or {}).get("engine", {}).get("max_model_len") if start_snap.get("workers") else None
        if limit and settings.max_prompt_tokens + settings.max_new_tokens + 80 > limit:
            settings.max_prompt_tokens = max(settings.min_prompt_tokens, limit - settings.max_new_tokens - 80)
            print(f"soak: max_model_len {limit}: prompts capped at {settings.max_prompt_tokens} tokens", flush=True)
        maker = PromptMaker(tokenizer, settings.seed)
        plans = make_plans(settings, maker, served)
        schedule = make_schedule(settings, len(plans))
        sampler = RssSampler(server_pid, worker_pids).start()
        if progress:
            print(f"soak: {len(plans)} requests against {url} in {sum(p[0] == 'burst' for p in schedule)} bursts", flush=True)
        records, t0, t1 = asyncio.run(drive(url, plans, schedule, settings, api_key=api_key, progress=progress))
        final, idle_wait = wait_idle(url, headers, settings.idle_timeout_s)
        sampler.stop()
        rss = sampler.summary(t0, t1)
        checks = evaluate(records, start_snap, final, rss, settings, idle_wait, server_pid is not None)
        if sampler.error:
            checks.append({"name": "rss_sampler_errors", "ok": False, "detail": sampler.error})
    finally:
        if sampler is not None:
            sampler.stop()
        exit_code = server.stop() if server is not None else None

    result = _result(model, model_path, devices, settings, serve_cmd, url, start_s, plans, records, t0, t1, start_snap, final,
                     idle_wait, rss, sampler, checks, max_model_len, max_active_requests, time.perf_counter() - t_wall,
                     provenance)
    result["server_exit_code"] = exit_code
    if server is not None:
        result["checks"].append({"name": "server_clean_exit", "ok": exit_code == 0 and not server.orphans,
                                 "detail": f"exit code {exit_code} after Ctrl-C; worker processes left behind: "
                                           f"{server.orphans or 'none'}"})
        result["ok"] = all(c["ok"] for c in result["checks"])
        if result["ok"]:
            shutil.rmtree(log_dir, ignore_errors=True)
        else:
            result["server_log"] = str(server.log_path)
            result["server_log_tail"] = server.log_tail(60)
    if write:
        label = Path(model).stem if str(model).endswith(".gguf") or "/" in str(model) else str(model)
        name = f"soak-{tag or device_tag(devices) + '-' + label}"
        json_path, md_path = _write(result, Path(out_dir) if out_dir else RESULTS_DIR, name)
        result["files"] = [str(json_path), str(md_path)]
    if progress:
        print_summary(result)
    return result


def _result(model, model_path, devices, settings, serve_cmd, url, start_s, plans, records, t0, t1, start_snap, final,
            idle_wait, rss, sampler, checks, max_model_len, max_active_requests, wall_s, provenance) -> dict:
    from minivllm.models.cache import sha256_file

    by = Counter(r.outcome for r in records)
    fin = [r for r in records if r.outcome == "finished"]
    e2e = [r.t_end - r.t_start for r in fin]
    ttft = [r.t_first - r.t_start for r in fin if r.stream and r.t_first is not None]
    load_s = max(1e-9, t1 - t0)
    tokens = sum(r.completion_tokens or 0 for r in fin)
    counters = {}
    for snap, sign in ((final, 1), (start_snap, -1)):
        for w in snap.get("workers") or []:
            for k, v in ((w.get("snapshot") or {}).get("counters") or {}).items():
                counters[k] = counters.get(k, 0) + sign * v
    summary = {
        "requests": len(records), "requests_planned": len(plans), "server_start_s": start_s, "load_s": round(load_s, 1), "wall_s": round(wall_s, 1),
        "idle_wait_s": round(idle_wait, 2), "requests_per_s": len(records) / load_s,
        "finished_per_s": len(fin) / load_s,
        "e2e_p50_s": percentile(e2e, 50), "e2e_p99_s": percentile(e2e, 99),
        "e2e_p50_stream_s": percentile([r.t_end - r.t_start for r in fin if r.stream], 50),
        "e2e_p50_nonstream_s": percentile([r.t_end - r.t_start for r in fin if not r.stream], 50),
        "ttft_p50_stream_s": percentile(ttft, 50), "ttft_p99_stream_s": percentile(ttft, 99),
        "finished_completion_tokens": tokens, "finished_completion_tok_per_s": tokens / load_s,
        "engine_decode_tokens": counters.get("decode_tokens"), "engine_prefill_tokens": counters.get("prefill_tokens"),
        "engine_decode_tok_per_s": (counters.get("decode_tokens") or 0) / load_s,
        "engine_prefill_tok_per_s": (counters.get("prefill_tokens") or 0) / load_s,
        "engine_preemptions": counters.get("preemptions"),
        "prompt_tokens_min": min((r.prompt_tokens for r in records if r.prompt_tokens), default=None),
        "prompt_tokens_max": max((r.prompt_tokens for r in records if r.prompt_tokens), default=None),
    }
    ledger, ledger0 = final.get("requests") or {}, start_snap.get("requests") or {}
    ended = dict(_ended(ledger) - _ended(ledger0))
    per_worker = {}
    for w in final.get("workers") or []:
        s = w.get("snapshot") or {}
        kv, pc = s.get("kv") or {}, s.get("prefix_cache") or {}
        per_worker[w["name"]] = {"state": w.get("state"), "counters": w.get("counters"),
                                 "engine_counters": s.get("counters"),
                                 "page_states": dict(Counter(kv.get("page_states") or [])),
                                 "total_pages": kv.get("total_pages"), "available_pages": kv.get("available_pages"),
                                 "prefix_cache": {k: pc.get(k) for k in ("cached_pages", "idle_pages", "in_use_pages",
                                                                         "hits", "lookups", "hit_rate", "evicted_pages")}}
    routed = Counter(r.worker for r in fin if r.worker)
    failures = [asdict(r) for r in records
                if r.outcome in ("http_error", "stream_error", "transport_error", "protocol_error")]
    notes = (f"{len(records)} requests against `minivllm serve` ({', '.join(devices)}; {model}); "
             f"cancel {settings.cancel_fraction:.0%}, disconnect {settings.disconnect_fraction:.0%}, "
             f"max_tokens 1..{settings.max_new_tokens}, prompts {settings.min_prompt_tokens}..{settings.max_prompt_tokens} "
             f"tokens, bursts {settings.burst[0]}..{settings.burst[1]} with {settings.gap_s[0]}..{settings.gap_s[1]} s "
             f"gaps and a {settings.trickle_rate}/s trickle.")
    cfg = {"model": model, "devices": devices, "url": url, "serve_args": serve_cmd, "max_model_len": max_model_len,
           "max_active_requests": max_active_requests, **asdict(settings)}
    return {
        "benchmark": "soak",
        "provenance": provenance(_provenance_device(devices), sha256_file(Path(model_path)) if model_path else None, cfg),
        "notes": notes,
        "ok": all(c["ok"] for c in checks),
        "checks": checks,
        "rows": [{"ending": k, "count": by.get(k, 0)} for k in OUTCOMES],
        "summary": summary,
        "client": {
            "by_outcome": {k: by.get(k, 0) for k in OUTCOMES},
            "by_outcome_streamed": dict(Counter(r.outcome for r in records if r.stream)),
            "by_outcome_chat": dict(Counter(r.outcome for r in records if r.endpoint == "chat")),
            "by_action": dict(Counter(r.action for r in records)),
            "action_x_outcome": {a: dict(Counter(r.outcome for r in records if r.action == a))
                                 for a in ("normal", "cancel", "disconnect")},
            "cancel_phase": dict(Counter(r.cancel_phase for r in records if r.outcome == "cancelled")),
            "cancel_mode_x_outcome": {m: dict(Counter(r.outcome for r, p in zip(records, plans) if p.cancel_mode == m))
                                      for m in ("early", "timed", "mid_stream")},
            "finish_reasons": dict(Counter(r.finish_reason for r in fin)),
            "finished_by_kind": {f"{e}/{'stream' if st else 'json'}": sum(1 for r in fin if r.endpoint == e and r.stream == st)
                                 for e in ("completions", "chat") for st in (False, True)},
            "finished_by_worker": dict(routed),
            "http_statuses": dict(Counter(str(r.status) for r in records if r.status is not None)),
        },
        "server": {"submitted": ledger.get("submitted", 0) - ledger0.get("submitted", 0), "ended": ended,
                   "open": ledger.get("open"), "open_ids": ledger.get("open_ids"),
                   "duplicate_terminals": ledger.get("duplicate_terminals"), "ledger_final": ledger,
                   "engine_counters_delta": counters, "per_worker": per_worker},
        "rss": rss,
        "rss_series": sampler.series(t0) if sampler else {},
        "failures": failures,
    }


def _provenance_device(devices: list[str]) -> str:
    """The device named in the provenance: the first CUDA worker's, else the CPU."""
    for d in devices:
        if d.startswith("cuda"):
            return d.split("#")[0]
        if d == "gpu":
            return "cuda:0"
    return "cpu"


def print_summary(result: dict) -> None:
    s = result["summary"]
    print(f"\nsoak: {'PASS' if result['ok'] else 'FAIL'}: {s['requests']} requests in {s['load_s']} s "
          f"({s['requests_per_s']:.2f} req/s, {s['finished_completion_tok_per_s']:.1f} finished tok/s, engine decode "
          f"{s['engine_decode_tok_per_s']:.1f} tok/s); e2e p50 {_f(s['e2e_p50_s'])} s p99 {_f(s['e2e_p99_s'])} s; "
          f"stream TTFT p50 {_f(s['ttft_p50_stream_s'])} s p99 {_f(s['ttft_p99_stream_s'])} s")
    print("  client: " + ", ".join(f"{k} {v}" for k, v in result["client"]["by_outcome"].items()))
    srv = result["server"]
    print(f"  server: submitted {srv['submitted']}, ended {srv['ended']}, open {srv['open']}, "
          f"duplicate terminals {srv['duplicate_terminals']}")
    for name, r in result["rss"].items():
        print(f"  rss {name}: {r['first_quarter_mb']:.1f} -> {r['last_quarter_mb']:.1f} MB "
              f"({r['delta_mb']:+.1f} MB, x{r['ratio']:.3f}), max {r['max_mb']:.1f} MB, {r['samples']} samples")
    for c in result["checks"]:
        print(f"  [{'ok' if c['ok'] else 'FAIL'}] {c['name']}: {c['detail'][:200]}")
    for f in result.get("files", []):
        print(f"  wrote {f}")
    sys.stdout.flush()
