"""The soak's workload: the settings, one planned request each (`Plan`), its client-side record
(`Record`), and the seeded arrival schedule of bursts, drains and trickles (see soak.py)."""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

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
        action = (
            "cancel"
            if r < s.cancel_fraction
            else "disconnect"
            if r < s.cancel_fraction + s.disconnect_fraction
            else "normal"
        )
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
                messages += [
                    {"role": "user", "content": "Hi."},
                    {"role": "assistant", "content": "Hello! How can I help?"},
                ]
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
