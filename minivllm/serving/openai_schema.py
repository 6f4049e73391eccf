"""Request bodies of the OpenAI-compatible API, as pydantic models (they also make the
server's OpenAPI schema), and their translation into `SamplingParams`.

Fields the engine cannot honour (n > 1, best_of, echo, logprobs, suffix) are refused with
a 400 naming the field rather than silently ignored. minivllm extensions (top_k, min_p,
repetition_penalty, ignore_eos) are accepted like vLLM's.

Structured output: `response_format` (json_object, json_schema) on both endpoints, and
vLLM's `guided_json` / `guided_regex` / `guided_grammar` / `guided_choice` and
`structured_outputs` (structured_request.py; one source per request). Tool calls: `tools`
and `tool_choice` on chat completions (tool_calls.py); messages may carry the assistant's
`tool_calls` and the `tool` role's answers (`tool_call_id`), which the chat template renders.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from minivllm.errors import ConfigError
from minivllm.sampling.constraint_limits import check_json_depth, loads_client_json
from minivllm.sampling.sampling_params import LOGIT_BIAS_LIMIT, LOGIT_BIAS_MAX_ENTRIES, SamplingParams
from minivllm.sampling.structured import StructuredOutput
from minivllm.serving.structured_request import structured_from_request
from minivllm.serving.tool_calls import ToolRequest, tool_request

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
    # Keys are token ids as strings (JSON object keys); SamplingParams checks the ids, the
    # range and the entry bound (a 400 naming them), the cluster the vocabulary. The schema
    # states the same for clients and fuzzers.
    logit_bias: dict[str, float] | None = Field(
        default=None, description=f"token id -> bias in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], at most "
                                  f"{LOGIT_BIAS_MAX_ENTRIES} entries, ids in the model's vocabulary",
        json_schema_extra={"maxProperties": LOGIT_BIAS_MAX_ENTRIES, "propertyNames": {"pattern": "^(0|[1-9][0-9]*)$"},
                           "additionalProperties": {"type": "number", "minimum": -LOGIT_BIAS_LIMIT,
                                                    "maximum": LOGIT_BIAS_LIMIT}})
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Structured output (structured_request.py): OpenAI's field and vLLM's.
    response_format: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: dict | None = None

    def structured(self, tools: ToolRequest | None = None) -> StructuredOutput | None:
        forced = tools.constraint() if tools is not None else None
        return structured_from_request(
            response_format=self.response_format, structured_outputs=self.structured_outputs,
            guided_json=self.guided_json, guided_regex=self.guided_regex, guided_grammar=self.guided_grammar,
            guided_choice=self.guided_choice, extra={"tool_choice": forced} if forced is not None else None)

    @property
    def format_field(self) -> str | None:
        """The first output-format field set (response_format other than text, guided_*,
        structured_outputs), or None; what it holds is checked when params are built."""
        if self.response_format is not None and self.response_format.get("type") != "text":
            return "response_format"
        names = ("guided_json", "guided_regex", "guided_grammar", "guided_choice", "structured_outputs")
        return next((n for n in names if getattr(self, n) is not None), None)

    @property
    def constraint_field(self) -> str | None:
        """The field the request's constraint came from (for errors found while generating)."""
        forced = getattr(self, "tool_choice", None) not in (None, "none", "auto")
        return "tool_choice" if forced else self.format_field

    def sampling_params(self, default_max_tokens: int, tools: ToolRequest | None = None) -> SamplingParams:
        if self.n != 1:
            raise ConfigError("n", self.n, "only n=1 is supported; send several requests instead")
        structured = self.structured(tools)
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP_SEQUENCES:
            raise ConfigError("stop", f"<{len(stop)} sequences>", f"give at most {MAX_STOP_SEQUENCES} stop sequences")
        stop = [checked_text(f"stop[{i}]", text) for i, text in enumerate(stop)]
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.repetition_penalty, seed=self.seed, stop=stop,
                              stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
                              structured=structured, logit_bias=self.logit_bias,
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
    tools: list | None = None  # chat completions only
    tool_choice: str | dict | None = None

    def prompt_input(self) -> str | list[int]:
        for name in ("tools", "tool_choice"):
            if getattr(self, name) not in (None, [], "none"):
                raise ConfigError(name, f"<{name}>", "tool calls are for /v1/chat/completions, not text completions")
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
    tool_calls: list[dict] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: the call it answers

    def template_message(self, i: int) -> dict:
        """The message as chat templates read it (Hugging Face's convention): a call's
        arguments as an object, not JSON text, since templates write them with tojson."""
        if self.role not in ROLES:
            raise ConfigError(f"messages[{i}].role", self.role, f"allowed: {', '.join(ROLES)}")
        content = self.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ConfigError(f"messages[{i}].content", part.get("type"), "only text parts are supported")
                parts.append(part["text"])
            content = "".join(parts)
        out = {"role": self.role, "content": checked_text(f"messages[{i}].content", content or "")}
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = checked_text(f"messages[{i}].{key}", getattr(self, key))
        if self.tool_calls:
            if self.role != "assistant":
                raise ConfigError(f"messages[{i}].tool_calls", f"<role {self.role}>", "only assistant messages carry "
                                  "tool_calls")
            out["tool_calls"] = [_template_call(f"messages[{i}].tool_calls[{j}]", call)
                                 for j, call in enumerate(self.tool_calls)]
        return out


def _template_call(field: str, call: dict) -> dict:
    check_json_depth(field, call)  # the chat template walks it recursively
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ConfigError(f"{field}.function", fn, 'must be {"name": ..., "arguments": "<JSON text>"}')
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        args = loads_client_json(
            f"{field}.function.arguments", checked_text(f"{field}.function.arguments", args) or "{}"
        )
    else:
        check_json_depth(f"{field}.function.arguments", args)
    return {**call, "type": call.get("type", "function"), "function": {**fn, "arguments": args}}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None

    def tool_request(self, chat_template: str | None) -> ToolRequest | None:
        tools = tool_request(self.tools, self.tool_choice, chat_template)
        if tools is not None and tools.choice == "auto":  # an output format wins over reading calls
            tools.read_calls = self.format_field is None
        return tools

    def chat_messages(self) -> list[dict]:
        if self.logprobs:
            raise ConfigError("logprobs", self.logprobs, "logprobs are not served over HTTP yet; use the Python API")
        if self.top_logprobs:
            raise ConfigError("top_logprobs", self.top_logprobs, "top_logprobs needs logprobs, which are not served "
                              "over HTTP yet; leave it out or use the Python API")
        if not self.messages:
            raise ConfigError("messages", [], "give at least one message")
        out = [m.template_message(i) for i, m in enumerate(self.messages)]
        if not any(m["content"] or m.get("tool_calls") for m in out):
            raise ConfigError("messages", "<all empty>", "at least one message needs content")
        return out

    def sampling_params(self, default_max_tokens: int, tools: ToolRequest | None = None) -> SamplingParams:
        if self.max_completion_tokens is not None and self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling_params(default_max_tokens, tools)


class ErrorBody(BaseModel):
    message: str
    type: Literal["invalid_request_error", "authentication_error", "rate_limit_error", "server_error",
                  "service_unavailable"]
    param: str | None = None
    code: str | None = None
