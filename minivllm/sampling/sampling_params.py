"""Per-request sampling settings, validated once when the request is made.

Shaped like vLLM's `SamplingParams` so code moves between the two. Every invalid
value raises `ConfigError` naming the field and the allowed range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from minivllm.errors import ConfigError
from minivllm.sampling.structured import StructuredOutput

# OpenAI's bounds for logit_bias: at most 300 entries, each added to its token's logit
# before anything else (penalties, temperature, filters, a constraint's mask); -100 bans a
# token in practice, +100 all but forces it.
LOGIT_BIAS_MAX_ENTRIES = 300
LOGIT_BIAS_LIMIT = 100.0


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_window: int = 0  # 0: whole context (prompt + output)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 16
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # top-n log-probabilities per generated token (0..20)
    # The output must match a JSON schema, regex, grammar or choice (structured.py).
    structured: StructuredOutput | None = None
    # token id -> a number in [-100, 100] added to its logit. JSON object keys arrive as
    # strings ("50256"); they are turned into ints here. Ids are checked against the
    # model's vocabulary by `check_token_ids` once the vocabulary is known.
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            # NaN slips through every comparison below and inf through some; neither is a setting.
            self._check(name, isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                        "must be a finite number")
        self._check("temperature", self.temperature >= 0, "must be >= 0 (0 = greedy)")
        if self.top_k == -1:
            self.top_k = 0
        self._check(
            "top_k", isinstance(self.top_k, int) and self.top_k >= 0, "must be an integer >= 0 (0 or -1 disables it)"
        )
        self._check("top_p", 0 < self.top_p <= 1, "must be in (0, 1]")
        self._check("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]")
        self._check("repetition_penalty", self.repetition_penalty > 0, "must be > 0 (1 disables it)")
        self._check("repetition_window", isinstance(self.repetition_window, int) and self.repetition_window >= 0,
                    "must be an integer >= 0 (0 = whole context)")
        self._check("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]")
        self._check("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]")
        self._check("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 1, "must be an integer >= 1")
        self._check("seed", self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
                    "must be None or an integer in [0, 2**63)")
        self._check("logprobs", self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
                    "must be None or an integer in [0, 20]")
        self._check("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings")
        self._check("stop_token_ids", all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                    "must be non-negative token ids")
        self.structured = StructuredOutput.coerce(self.structured)
        self.logit_bias = _checked_logit_bias(self.logit_bias)

    def check_token_ids(self, vocab: int) -> None:
        """The token ids this request names (stop_token_ids, logit_bias keys) exist in a
        vocabulary of `vocab` tokens; raises ConfigError naming the field and the range."""
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise ConfigError("stop_token_ids", bad[:5], f"token ids must be integers in [0, {vocab})")
        bad = [t for t in (self.logit_bias or {}) if not 0 <= t < vocab]
        if bad:
            raise ConfigError("logit_bias", bad[:5], f"keys must be token ids in [0, {vocab}) (the model's vocabulary)")

    def _check(self, name: str, ok: bool, allowed: str) -> None:
        if not ok:
            raise ConfigError(name, getattr(self, name), allowed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _checked_logit_bias(bias) -> dict[int, float] | None:
    """`bias` as {token id: float}, or None when empty; ConfigError naming what is wrong."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ConfigError("logit_bias", type(bias).__name__, "must be an object mapping token ids to numbers")
    if len(bias) > LOGIT_BIAS_MAX_ENTRIES:
        raise ConfigError("logit_bias", f"<{len(bias)} entries>", f"give at most {LOGIT_BIAS_MAX_ENTRIES} entries")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = key
        if isinstance(key, str) and key.isascii() and key.isdigit():
            token = int(key)
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise ConfigError("logit_bias", str(key)[:40], "keys must be token ids (integers >= 0, or their decimal "
                              "strings as JSON sends them)")
        if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
                or not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT):
            raise ConfigError(f"logit_bias[{token}]", value if isinstance(value, (int, float)) else str(value)[:40],
                              f"bias values must be numbers in [{-LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]")
        out[token] = float(value)
    return out or None
