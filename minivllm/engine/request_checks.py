"""What a request must satisfy before the engine admits it: each failure is a ConfigError
that names the field and the fix, raised in `add_request`, before anything is allocated."""

from __future__ import annotations

from minivllm.cache.page_pool import PagePool
from minivllm.errors import ConfigError
from minivllm.sampling.sampling_params import SamplingParams


def check_request(prompt_ids: list[int], params: SamplingParams, *, request_id: str | None, taken: bool, vocab: int,
                  max_model_len: int, pool: PagePool, scratch_page: bool) -> None:
    """`taken`: `request_id` is already in use; `scratch_page`: the CUDA graphs hold one page."""
    if not isinstance(params, SamplingParams):
        raise ConfigError("params", type(params).__name__, "expected a SamplingParams")
    if request_id is not None and taken:
        raise ConfigError("request_id", request_id, "is already in use; give a unique id or none")
    if not prompt_ids:
        raise ConfigError("prompt", "", "must contain at least one token")
    bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise ConfigError("prompt_token_ids", bad[:5], f"token ids must be integers in [0, {vocab})")
    params.check_token_ids(vocab)
    if len(prompt_ids) >= max_model_len:
        raise ConfigError("prompt", f"<{len(prompt_ids)} tokens>",
                          f"the prompt must be shorter than max_model_len={max_model_len}; "
                          f"shorten it or raise max_model_len")
    longest = min(len(prompt_ids) + params.max_tokens, max_model_len)
    usable = pool.num_pages - (1 if scratch_page else 0)
    if pool.pages_for(longest) > usable:
        raise ConfigError("max_tokens", params.max_tokens,
                          f"prompt + max_tokens needs {pool.pages_for(longest)} KV pages but the pool only has "
                          f"{usable}; lower max_tokens or raise kv_memory_bytes")
