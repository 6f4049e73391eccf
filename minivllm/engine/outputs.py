"""What a finished (or streaming) request hands back to the caller."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestMetrics:
    prompt_tokens: int = 0
    output_tokens: int = 0
    time_to_first_token_s: float = 0.0
    e2e_s: float = 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        decode_time = self.e2e_s - self.time_to_first_token_s
        return (self.output_tokens - 1) / decode_time if self.output_tokens > 1 and decode_time > 0 else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "decode_tokens_per_s": self.decode_tokens_per_s}


@dataclass
class TokenEvent:
    """One generated token as seen by a streaming client."""

    request_id: str
    token_id: int
    text: str  # newly completed text (may be "" while UTF-8 or a stop string is pending)
    finished: bool = False
    finish_reason: str | None = None  # "stop" (EOS, stop string/token) or "length"


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
