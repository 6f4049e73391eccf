"""`LLM`: the offline Python API, shaped like vLLM's.

    llm = LLM(model="smollm2-135m", device="cpu", dtype="float32")
    outs = llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=32))

`model` is a registered name (see `minivllm models list`) or a path to a .gguf file.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import torch

from minivllm.devices import check_dtype_supported, describe_device, dtype_name, resolve_device, resolve_dtype
from minivllm.engine.engine import LLMEngine
from minivllm.engine.engine_config import EngineConfig
from minivllm.engine.options import options_summary
from minivllm.engine.request_checks import is_token_ids
from minivllm.errors import ConfigError
from minivllm.gguf.reader import GGUFFile
from minivllm.gguf.tokenizer import Tokenizer
from minivllm.model.loader import load_model
from minivllm.models import resolve_model
from minivllm.sampling.outputs import RequestOutput, TokenEvent
from minivllm.sampling.sampling_params import SamplingParams

Prompt = str | list[int]
Messages = list[dict]


class LLM:
    def __init__(self, model: str = "smollm2-135m", device: str = "cpu", dtype: str = "float32", *,
                 max_model_len: int | None = None, progress: bool = True, draft_model: str | None = None,
                 **engine_options):
        """`engine_options` are `EngineConfig` fields (see `minivllm generate --help`), by
        group: {options}. `draft_model` (a name or path, loaded on the same device and
        dtype) turns speculative decoding on."""
        engine_config = EngineConfig(max_model_len=max_model_len, **engine_options)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype)
        check_dtype_supported(self.device, self.dtype)
        self.model_path = resolve_model(model, progress=progress)
        self.gguf = GGUFFile(self.model_path)
        self.tokenizer = Tokenizer.from_gguf(self.gguf)
        self.model = load_model(self.gguf, self.device, self.dtype, progress=progress,
                                kernel_options=engine_config.kernel_options())
        self.config = self.model.config
        self.draft_model_path = self.draft = self.draft_tokenizer = None
        if draft_model is not None:
            self.draft_model_path = resolve_model(draft_model, progress=progress)
            draft_gguf = GGUFFile(self.draft_model_path)
            self.draft_tokenizer = Tokenizer.from_gguf(draft_gguf)
            self.draft = load_model(draft_gguf, self.device, self.dtype, progress=progress,
                                    kernel_options=engine_config.kernel_options())
        self.engine = self._make_engine(engine_config)
        self.max_model_len = self.engine.max_model_len
        self._engine_options = dict(engine_options, max_model_len=max_model_len)

    def fork(self, **engine_options) -> "LLM":
        """A new `LLM` over the same loaded weights and tokenizer with its own engine
        (fresh KV pool and queues) built from `engine_options`; unspecified options keep
        this LLM's values. Use it to compare settings without loading the model twice."""
        options = {**self._engine_options, **engine_options}
        other = object.__new__(LLM)
        other.__dict__.update({k: v for k, v in self.__dict__.items() if k not in ("engine", "_engine_options")})
        max_model_len = options.pop("max_model_len", None)
        other.engine = other._make_engine(EngineConfig(max_model_len=max_model_len, **options))
        other.max_model_len = other.engine.max_model_len
        other._engine_options = dict(options, max_model_len=max_model_len)
        return other

    def engine_options(self) -> dict:
        """The engine options this LLM was built (or forked) with, `max_model_len` included:
        what `LLM(path, **options)` needs to build the same engine over another load."""
        return dict(self._engine_options)

    def _make_engine(self, config: EngineConfig) -> LLMEngine:
        name = self.draft_model_path.name if self.draft_model_path is not None else "draft"
        return LLMEngine(self.model, self.tokenizer, config, draft_model=self.draft,
                         draft_tokenizer=self.draft_tokenizer, draft_name=name)

    # -- prompts ---------------------------------------------------------------------

    def _prompt_ids(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if is_token_ids(prompt):
            return None, list(prompt)
        raise ConfigError("prompt", type(prompt).__name__, "expected a string or a list of token ids")

    def chat_prompt(self, messages: Messages) -> str:
        """The prompt text the model's own chat template makes of `messages` (to read; to
        generate from, use `chat_prompt_ids`: encoding this text would turn control-token
        text in a message into real control tokens)."""
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def chat_prompt_ids(self, messages: Messages) -> tuple[str, list[int]]:
        """The chat prompt's text and ids, with control tokens only where the template put
        them: message content is always encoded as plain text (Tokenizer.encode_chat)."""
        return self.tokenizer.encode_chat(messages, add_generation_prompt=True)

    # -- generation --------------------------------------------------------------------

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[TokenEvent]:
        """Yield this request's token events as they are produced (the CLI prints these).

        Other requests already in the engine keep running in the same steps.
        """
        text, ids = self._prompt_ids(prompt)
        rid = self.engine.add_request(ids, params or SamplingParams(), prompt=text)
        try:
            for events in self.engine.run():
                for event in events:
                    if event.request_id == rid:
                        yield event
                        if event.finished:
                            return
        finally:
            self.engine.release(rid)  # a consumer that stops early cancels the request

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts together through the continuous-batching engine; outputs in input order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ConfigError(
                "params", f"<{len(params)} items>", f"give one SamplingParams or one per prompt ({len(prompts)})"
            )
        encoded = [self._prompt_ids(p) for p in prompts]  # validate everything before submitting anything
        return self._generate_encoded(encoded, params)

    def _generate_encoded(self, encoded: list[tuple[str | None, list[int]]], params: Sequence[SamplingParams],
                          ) -> list[RequestOutput]:
        rids = []
        try:
            for (text, ids), p in zip(encoded, params):
                rids.append(self.engine.add_request(ids, p, prompt=text))
            engine = self.engine
            for _ in engine.run(until=lambda: all(engine.request_state(r).finished for r in rids)):
                pass
        except BaseException:
            for r in rids:
                self.engine.release(r)
            raise
        return [self.engine.pop_output(r) for r in rids]

    def chat(self, messages: Messages | Sequence[Messages], params: SamplingParams | None = None):
        """Generate a reply to one conversation (returns one output) or several (a list)."""
        single = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if single else list(messages)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(conversations)
        if len(params) != len(conversations):
            raise ConfigError("params", f"<{len(params)} items>",
                              f"give one SamplingParams or one per conversation ({len(conversations)})")
        outs = self._generate_encoded([self.chat_prompt_ids(m) for m in conversations], params)
        return outs[0] if single else outs

    # -- inspection ----------------------------------------------------------------------

    def snapshot(self) -> dict:
        return self.engine.snapshot()

    def info(self) -> dict:
        """A JSON-friendly summary for the notebook and the CLI."""
        return {
            "model_path": str(self.model_path),
            "device": describe_device(self.device),
            "activation_dtype": dtype_name(self.dtype),
            "max_model_len": self.max_model_len,
            "kv_mode": self.engine.config.kv_mode,
            "kv_pages": self.engine.pool.num_pages,
            "draft_model_path": str(self.draft_model_path) if self.draft_model_path is not None else None,
            "config": self.config.describe(),
            "torch": torch.__version__,
            "cpu_kernels": cpu_kernels(self.device),
            "cpu_threads": cpu_threads(),
        }


def cpu_kernels(device: torch.device) -> str | None:
    """On a CPU: the compiled kernels' instruction set ("avx2", "avx512"), or why they did
    not build (then attention and GEMVs run in plain torch, much slower); None on a GPU."""
    if device.type != "cpu":
        return None
    from minivllm.kernels import cpu_gemv

    return cpu_gemv.isa() or f"not built: {cpu_gemv.unavailable_reason()}"


def cpu_threads() -> dict:
    """The threads torch's CPU kernels use and the cores this process may run on: a CPU
    worker whose threads outnumber its cores, or share them with a busy neighbour, waits
    at every parallel region's barrier for its slowest thread."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = list(range(os.cpu_count() or 1))
    return {"torch": torch.get_num_threads(), "cores_allowed": len(cpus), "cpus": cpus}


def init_docstring() -> str:
    """`LLM.__init__`'s docstring with the option list read off the declarations."""
    return INIT_DOC_TEMPLATE.replace("{options}", options_summary(exclude=("max_model_len",)))


INIT_DOC_TEMPLATE = LLM.__init__.__doc__
LLM.__init__.__doc__ = init_docstring()
