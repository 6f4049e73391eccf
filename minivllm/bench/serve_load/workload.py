"""The load: settings, seeded prompts of random common words, arrival times, request bodies."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

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
