"""Request bodies of the OpenAI-compatible API, as pydantic models (they also make the
server's OpenAPI schema), and their translation into `SamplingParams`.

Fields the engine cannot honour (n > 1, best_of, echo, logprobs, response_format, tools) are refused with
a 400 naming the field rather than silently ignored. minivllm extensions (top_k, min_p,
repetition_penalty, ignore_eos) are accepted like vLLM's.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from minivllm.sampling.sampling_params import SamplingParams
from minivllm.errors import ConfigError

ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_STOP_SEQUENCES = 16


def checked_text(field: str, text: str) -> str:
    """JSON can carry lone UTF-16 surrogates ("\\ud800") that no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(field, text[max(0, exc.start - 8): exc.end + 8],
                          "contains a lone surrogate, which is not valid Unicode; send valid UTF-8 text") from None
    return text


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class _SamplingFields(BaseModel):
    # strict: JSON types are not coerced ("5" is not an integer, 1 is not a boolean), as in
    # OpenAI's API; unknown fields are ignored, as clients send extensions of other servers.
    model_config = ConfigDict(extra="ignore", strict=True)

    # The ranges are part of the OpenAPI schema (clients and fuzzers see them); SamplingParams
    # checks the same ones again for Python callers.
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1,
                                   description="tokens to generate (default 16 for completions, 256 for chat)")
    temperature: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=-1, description="0 or -1 disables it")
    min_p: float = Field(default=0.0, ge=0, le=1, allow_inf_nan=False)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2, allow_inf_nan=False)
    repetition_penalty: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, description="ids in [0, vocabulary size)")
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Structured output and tool calls are not implemented: refused with a 400, never ignored.
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.n != 1:
            raise ConfigError("n", self.n, "only n=1 is supported; send several requests instead")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise ConfigError("response_format", self.response_format, "structured output (json_object, json_schema) "
                              "is not supported yet; leave response_format out (or {\"type\": \"text\"})")
        if self.tools:
            raise ConfigError("tools", f"<{len(self.tools)} tools>", "tool calling is not supported yet; leave tools out")
        if self.tool_choice not in (None, "none"):
            raise ConfigError("tool_choice", self.tool_choice, "tool calling is not supported yet; leave tool_choice out")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP_SEQUENCES:
            raise ConfigError("stop", f"<{len(stop)} sequences>", f"give at most {MAX_STOP_SEQUENCES} stop sequences")
        stop = [checked_text(f"stop[{i}]", text) for i, text in enumerate(stop)]
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.repetition_penalty, seed=self.seed, stop=stop,
                              stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
                              max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] = Field(description="a string, a list of token ids, or a list with one string")
    echo: bool = False
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str | None = None

    def prompt_input(self) -> str | list[int]:
        if self.echo:
            raise ConfigError("echo", self.echo, "echo is not supported")
        if self.best_of not in (None, 1):
            raise ConfigError("best_of", self.best_of, "only best_of=1 is supported")
        if self.logprobs is not None:
            raise ConfigError("logprobs", self.logprobs, "logprobs are not served over HTTP yet; use the Python API")
        if self.suffix:
            raise ConfigError("suffix", self.suffix, "suffix is not supported")
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise ConfigError("prompt", f"<{len(prompt)} prompts>", "send one prompt per request")
            prompt = prompt[0]
        if isinstance(prompt, str) and not prompt:
            raise ConfigError("prompt", "", "must not be empty")
        if isinstance(prompt, str):
            checked_text("prompt", prompt)
        if isinstance(prompt, list) and not prompt:
            raise ConfigError("prompt", [], "must contain at least one token")
        return prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: str
    content: str | list[dict] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def chat_messages(self) -> list[dict]:
        if self.logprobs:
            raise ConfigError("logprobs", self.logprobs, "logprobs are not served over HTTP yet; use the Python API")
        if self.top_logprobs:
            raise ConfigError("top_logprobs", self.top_logprobs, "top_logprobs needs logprobs, which are not served "
                              "over HTTP yet; leave it out or use the Python API")
        if not self.messages:
            raise ConfigError("messages", [], "give at least one message")
        out = []
        for i, m in enumerate(self.messages):
            if m.role not in ROLES:
                raise ConfigError(f"messages[{i}].role", m.role, f"allowed: {', '.join(ROLES)}")
            content = m.content
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise ConfigError(f"messages[{i}].content", part.get("type"), "only text parts are supported")
                    parts.append(part["text"])
                content = "".join(parts)
            out.append({"role": m.role, "content": checked_text(f"messages[{i}].content", content or "")})
        if not any(m["content"] for m in out):
            raise ConfigError("messages", "<all empty>", "at least one message needs content")
        return out

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.max_completion_tokens is not None and self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling_params(default_max_tokens)


class ErrorBody(BaseModel):
    message: str
    type: Literal["invalid_request_error", "authentication_error", "rate_limit_error", "server_error",
                  "service_unavailable"]
    param: str | None = None
    code: str | None = None
