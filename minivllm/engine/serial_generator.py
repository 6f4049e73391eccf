"""Generate one request at a time over a contiguous KV cache.

This is the foundation's generation loop and the correctness reference for the
batching scheduler that replaces it: prefill the whole prompt in one forward, then
one forward per generated token.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from minivllm.cache.contiguous import ContiguousKVCache
from minivllm.engine.outputs import RequestOutput, TokenEvent
from minivllm.engine.sampler import make_generator, sample
from minivllm.engine.sampling_params import SamplingParams
from minivllm.engine.stop_strings import StopStringMatcher
from minivllm.errors import ConfigError
from minivllm.gguf.detokenizer import StreamingDetokenizer
from minivllm.gguf.tokenizer import Tokenizer
from minivllm.model.decoder import DecoderModel


class SerialGenerator:
    def __init__(self, model: DecoderModel, tokenizer: Tokenizer, max_model_len: int):
        self.model = model
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def stream(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               output: RequestOutput) -> Iterator[TokenEvent]:
        """Yield one TokenEvent per generated token, filling `output` as it goes."""
        if not prompt_ids:
            raise ConfigError("prompt", "", "must contain at least one token")
        if len(prompt_ids) >= self.max_model_len:
            raise ConfigError(
                "prompt", f"<{len(prompt_ids)} tokens>",
                f"the prompt must be shorter than max_model_len={self.max_model_len}; shorten it or raise max_model_len",
            )
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ConfigError("prompt_token_ids", bad[:5], f"token ids must be in [0, {vocab})")

        model, device = self.model, self.model.device
        cfg = model.config
        budget = min(self.max_model_len, len(prompt_ids) + params.max_tokens)
        cache = ContiguousKVCache(cfg.n_layers, budget, cfg.n_kv_heads, cfg.head_dim, model.dtype, device)
        generator = make_generator(params, device)
        detok = StreamingDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens)
        stops = StopStringMatcher(params.stop)
        eos = set() if params.ignore_eos else set(self.tokenizer.eos_ids)
        stop_ids = set(params.stop_token_ids)

        t0 = time.perf_counter()
        logits = model.forward(torch.tensor(prompt_ids, device=device), 0, cache)
        pos = len(prompt_ids)
        output.metrics.prompt_tokens = len(prompt_ids)
        context = list(prompt_ids)
        while True:
            token = sample(logits, context, output.token_ids, params, generator)
            if not output.token_ids:
                output.metrics.time_to_first_token_s = time.perf_counter() - t0
            output.token_ids.append(token)
            context.append(token)
            reason = None
            text = ""
            if token in eos or token in stop_ids:
                reason = "stop"
                text = stops.flush() if token in eos else stops.feed(detok.flush())[0] + stops.flush()
            else:
                text, hit = stops.feed(detok.push(token))
                if hit:
                    reason = "stop"
                elif len(output.token_ids) >= params.max_tokens or pos + 1 >= budget:
                    reason = "length"
                    more, _ = stops.feed(detok.flush())
                    text += more + stops.flush()
            output.text += text
            output.metrics.output_tokens = len(output.token_ids)
            output.metrics.e2e_s = time.perf_counter() - t0
            if reason is not None:
                output.finish_reason = reason
                yield TokenEvent(request_id, token, text, finished=True, finish_reason=reason)
                return
            yield TokenEvent(request_id, token, text)
            logits = model.forward(torch.tensor([token], device=device), pos, cache)
            pos += 1
