"""What a request must satisfy before it is admitted: each failure is a ConfigError that
names the field and the fix. The one home of these rules: `LLM` (prompts as token ids),
`LLMEngine.add_request` (everything, before anything is allocated) and `Cluster.submit`
(before routing; the HTTP API submits through it) all call this module.

One rule differs by caller, as a flag: OpenAI's API refuses a request whose prompt plus
max_tokens exceeds the context (`whole_output_fits=True`, what `Cluster` asks), where
the engine alone stops such a request at max_model_len with finish_reason "length".
"""

from __future__ import annotations

from minivllm.cache.page_pool import PagePool
from minivllm.errors import ConfigError
from minivllm.sampling.sampling_params import SamplingParams


def is_token_ids(prompt) -> bool:
    """A prompt given as token ids: a list or tuple of ints. A bool is not a token id
    (`isinstance(True, int)` holds in Python, so it is refused by name)."""
    return isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)


def check_prompt(prompt_ids: list[int], params: SamplingParams, *, vocab: int | None, max_model_len: int | None,
                 whole_output_fits: bool = False) -> None:
    """The checks that need only the model's limits (None: not known yet, skipped)."""
    if not isinstance(params, SamplingParams):
        raise ConfigError("params", type(params).__name__, "expected a SamplingParams")
    if not prompt_ids:
        raise ConfigError("prompt", "", "must contain at least one token")
    if vocab is not None:
        bad = [t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ConfigError("prompt_token_ids", bad[:5], f"token ids must be integers in [0, {vocab})")
        params.check_token_ids(vocab)
    if max_model_len is None:
        return
    if len(prompt_ids) >= max_model_len:
        raise ConfigError("prompt", f"<{len(prompt_ids)} tokens>",
                          f"the prompt must be shorter than max_model_len={max_model_len}; "
                          f"shorten it or raise max_model_len")
    if whole_output_fits and len(prompt_ids) + params.max_tokens > max_model_len:
        raise ConfigError("max_tokens", params.max_tokens, f"the prompt has {len(prompt_ids)} tokens, so at most "
                          f"{max_model_len - len(prompt_ids)} more fit in max_model_len={max_model_len}; "
                          f"lower max_tokens")


def check_request(prompt_ids: list[int], params: SamplingParams, *, request_id: str | None, taken: bool, vocab: int,
                  max_model_len: int, pool: PagePool, scratch_page: bool) -> None:
    """The engine's admission: `check_prompt`, a free request id, and room in the KV pool.
    `taken`: `request_id` is already in use; `scratch_page`: the CUDA graphs hold one page."""
    if not isinstance(params, SamplingParams):
        raise ConfigError("params", type(params).__name__, "expected a SamplingParams")
    if request_id is not None and taken:
        raise ConfigError("request_id", request_id, "is already in use; give a unique id or none")
    check_prompt(prompt_ids, params, vocab=vocab, max_model_len=max_model_len)
    longest = min(len(prompt_ids) + params.max_tokens, max_model_len)
    usable = pool.num_pages - (1 if scratch_page else 0)
    if pool.pages_for(longest) > usable:
        raise ConfigError("max_tokens", params.max_tokens,
                          f"prompt + max_tokens needs {pool.pages_for(longest)} KV pages but the pool only has "
                          f"{usable}; lower max_tokens or raise kv_memory_bytes")
