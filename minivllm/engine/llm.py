"""`LLM`: the offline Python API, shaped like vLLM's.

    llm = LLM(model="smollm2-135m", device="cpu", dtype="float32")
    outs = llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=32))

`model` is a registered name (see `minivllm models list`) or a path to a .gguf file.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import torch

from minivllm.devices import check_dtype_supported, describe_device, dtype_name, resolve_device, resolve_dtype
from minivllm.engine.outputs import RequestOutput, TokenEvent
from minivllm.engine.sampling_params import SamplingParams
from minivllm.engine.serial_generator import SerialGenerator
from minivllm.errors import ConfigError
from minivllm.gguf.reader import GGUFFile
from minivllm.gguf.tokenizer import Tokenizer
from minivllm.model.loader import load_model
from minivllm.models import resolve_model

Prompt = str | list[int]
Messages = list[dict]


class LLM:
    def __init__(self, model: str = "smollm2-135m", device: str = "cpu", dtype: str = "float32", *,
                 max_model_len: int | None = None, progress: bool = True):
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype)
        check_dtype_supported(self.device, self.dtype)
        self.model_path = resolve_model(model, progress=progress)
        self.gguf = GGUFFile(self.model_path)
        self.tokenizer = Tokenizer.from_gguf(self.gguf)
        self.model = load_model(self.gguf, self.device, self.dtype, progress=progress)
        self.config = self.model.config
        limit = self.config.context_length
        if max_model_len is not None and not 1 < max_model_len <= limit:
            raise ConfigError("max_model_len", max_model_len, f"must be in [2, {limit}] (the model's context length)")
        # A modest default keeps per-request KV allocation small on CPUs and T4s.
        self.max_model_len = max_model_len or min(limit, 4096)
        self._runner = SerialGenerator(self.model, self.tokenizer, self.max_model_len)
        self._ids = itertools.count()

    # -- prompts ---------------------------------------------------------------------

    def _prompt_ids(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ConfigError("prompt", type(prompt).__name__, "expected a string or a list of token ids")

    def chat_prompt(self, messages: Messages) -> str:
        """The prompt text the model's own chat template makes of `messages`."""
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    # -- generation --------------------------------------------------------------------

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[TokenEvent]:
        """Yield token events as they are produced (the CLI prints these)."""
        text, ids = self._prompt_ids(prompt)
        out = RequestOutput(f"req-{next(self._ids)}", text, ids)
        yield from self._runner.stream(out.request_id, ids, params or SamplingParams(), out)

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ConfigError("params", f"<{len(params)} items>", f"give one SamplingParams or one per prompt ({len(prompts)})")
        outputs = []
        for prompt, p in zip(prompts, params):
            text, ids = self._prompt_ids(prompt)
            out = RequestOutput(f"req-{next(self._ids)}", text, ids)
            for _ in self._runner.stream(out.request_id, ids, p, out):
                pass
            outputs.append(out)
        return outputs

    def chat(self, messages: Messages | Sequence[Messages], params: SamplingParams | None = None):
        """Generate a reply to one conversation (returns one output) or several (a list)."""
        single = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if single else list(messages)
        outs = self.generate([self.chat_prompt(m) for m in conversations], params)
        return outs[0] if single else outs

    # -- inspection ----------------------------------------------------------------------

    def info(self) -> dict:
        """A JSON-friendly summary for the notebook and the CLI."""
        return {
            "model_path": str(self.model_path),
            "device": describe_device(self.device),
            "activation_dtype": dtype_name(self.dtype),
            "max_model_len": self.max_model_len,
            "config": self.config.describe(),
            "torch": torch.__version__,
        }
