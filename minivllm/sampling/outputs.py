"""What a finished (or streaming) request hands back to the caller."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestMetrics:
    """Times are seconds from the request's arrival (submission)."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # restored from a prefix cache instead of computed
    output_tokens: int = 0
    queue_time_s: float = 0.0  # arrival -> first scheduled
    time_to_first_token_s: float = 0.0  # arrival -> first token sampled
    e2e_s: float = 0.0  # arrival -> finished (or last token so far)
    preemptions: int = 0
    # Speculative decoding counters (spec/stats.py: proposed, accepted, acceptance_rate,
    # bonus_tokens, rounds, plain_steps, draft_length_histogram, tv_mean, tv_max); None
    # when the engine has no draft model.
    speculation: dict | None = None

    @property
    def prefill_tokens_per_s(self) -> float:
        prefill_time = self.time_to_first_token_s - self.queue_time_s
        computed = self.prompt_tokens - self.cached_prompt_tokens
        return computed / prefill_time if prefill_time > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """(output tokens - 1) / (e2e - TTFT): the first token belongs to prefill."""
        decode_time = self.e2e_s - self.time_to_first_token_s
        return (self.output_tokens - 1) / decode_time if self.output_tokens > 1 and decode_time > 0 else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "prefill_tokens_per_s": self.prefill_tokens_per_s,
                "decode_tokens_per_s": self.decode_tokens_per_s}


@dataclass
class TokenEvent:
    """One generated token as seen by a streaming client."""

    request_id: str
    token_id: int
    text: str  # newly completed text (may be "" while UTF-8 or a stop string is pending)
    finished: bool = False
    finish_reason: str | None = None  # "stop" (EOS, stop string/token), "length", "abort" or "error"
    logprobs: dict[int, float] | None = None  # top-n (and the sampled token) when requested
    error: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    error: str | None = None  # what went wrong, when finish_reason is "error"
