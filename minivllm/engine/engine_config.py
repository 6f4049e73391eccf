"""Engine settings, validated once at construction with errors that name the field."""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.errors import ConfigError
from minivllm.kernels.kernel_options import KernelOptions, KernelSettings
from minivllm.option_field import option
from minivllm.spec.draft_policy import MAX_DRAFT_TOKENS, parse_draft_policy

KV_MODES = ("paged", "contiguous")
POLICIES = ("fcfs", "shortest-prefill-first", "round-robin")
PUBLICATIONS = ("at_completion", "incremental")
SINGLE_FLIGHT = ("off", "at_completion", "after_prefill")
PREFIX_CACHE_KV_MODES = ("paged",)  # where a page can be shared: contiguous pages hold whole sequences
_CPU_KV_CAP = 1 << 30


def settle_cache_options(kv_mode: str, prefix_cache: bool, single_flight: str) -> dict:
    """Cache controls set independently (the notebook's launcher form), settled by the
    rules `EngineConfig` checks instead of refused: no prefix cache where pages cannot be
    shared, no single flight without a prefix cache (followers restore from it)."""
    enabled = bool(prefix_cache) and kv_mode in PREFIX_CACHE_KV_MODES
    return {"prefix_cache": enabled, "single_flight": single_flight if enabled else "off"}


@dataclass
class EngineConfig(KernelSettings):
    """Every engine option, each declared once with its help and group (`option`): the
    kernel choices inherited from `KernelSettings`, then the fields below. The CLI flags,
    the KEY=VALUE parser and the widgets' defaults are read off these fields
    (engine/options.py)."""

    kv_mode: str = option("paged", "paged KV pages, or one contiguous page per sequence", "kv cache",
                          choices=KV_MODES)
    page_size: int = option(16, "tokens per KV page", "kv cache")
    kv_memory_bytes: int | None = option(
        None, "KV pool budget in bytes (default: enough for max_active_requests + handoff_rows full-length "
        "sequences, capped at 1 GiB on CPU and at half of the free memory on a GPU)", "kv cache")
    kv_memory_fraction: float | None = option(None, "KV pool budget as a fraction of free GPU memory, in (0, 0.95]",
                                              "kv cache")
    kv_shareable: bool = option(
        False, "a CPU KV pool in memory another local worker can map, so the prefill worker of a split request "
        "writes its K/V straight into this pool's pages (cache/shared_pool_memory.py); CPU serving workers set it",
        "kv cache")
    max_model_len: int | None = option(None, "longest sequence (prompt + output); default min(model context, 4096)",
                                       "scheduler")
    max_batched_tokens: int = option(512, "per-step token budget (decode rows + prefill chunks)", "scheduler")
    max_active_requests: int = option(16, "requests the scheduler runs at once (per worker)", "scheduler")
    handoff_rows: int = option(
        0, "rows beyond max_active_requests for the prefill halves of split requests, which leave for another "
        "worker after their first token: a worker whose slots are all taken can still run them (a local cluster "
        "of several workers keeps 2 unless told)",
        "scheduler")
    policy: str = option("fcfs", "which waiting request is admitted first", "scheduler", choices=POLICIES)
    enforce_eager: bool = option(False, "no CUDA graphs (decode steps and prompt chunks)", "kernels")
    prefill_graphs: bool = option(
        True, "steps with prompt chunks replay CUDA graphs too (per row-count bucket), their attention through "
        "the paged kernel (engine/prefill_graphs.py)", "kernels")
    async_scheduling: bool = option(
        True, "queue the next decode step before reading this one's tokens, when it can only be the same rows "
        "one position further (CUDA graphs, plain greedy rows; engine/step_pipeline.py)", "scheduler")
    # Prefix cache (cache/prefix_index.py, cache/flight_coordinator.py).
    prefix_cache: bool | None = option(
        None, "share full KV pages between requests with a common prefix (default: on in paged mode, off in "
        "contiguous mode, where a page is a whole sequence and nothing could be shared)", "prefix cache")
    publication: str = option(
        "incremental", "when a request's full pages become reusable: incremental = after every forward that "
        "completes one, at_completion = when the request finishes", "prefix cache", choices=PUBLICATIONS)
    single_flight: str = option(
        "off", "requests with identical input ids wait for one leader's pages, released at_completion of the "
        "leader or after_prefill", "prefix cache", choices=SINGLE_FLIGHT)
    # Speculative decoding (minivllm/spec/), used when the engine is given a draft model.
    draft_policy: str | None = option(
        None, "each request's proposal length: fixed[:k], acceptance-rate[:init,dec,inc,min,max], "
        "accepted-length[:init,alpha,min,max], adaptive, or any policy with '+gate' (default fixed)", "speculative")
    num_draft_tokens: int = option(4, "draft tokens per round: k of 'fixed', the starting k of the adaptive "
                                   "policies", "speculative")
    tv_budget: float = option(0.0, "mentored decoding's total-variation budget D in [0, 1]: 0 = lossless, 1 = "
                              "accept every draft token (greedy requests ignore it)", "speculative")

    def __post_init__(self) -> None:
        super().__post_init__()  # the kernel settings, and every field's declared choices
        if not (isinstance(self.page_size, int) and self.page_size >= 1):
            raise ConfigError("page_size", self.page_size, "must be an integer >= 1 (default 16)")
        if self.kv_memory_bytes is not None and self.kv_memory_bytes <= 0:
            raise ConfigError("kv_memory_bytes", self.kv_memory_bytes, "must be > 0")
        if self.kv_memory_fraction is not None and not 0 < self.kv_memory_fraction <= 0.95:
            raise ConfigError("kv_memory_fraction", self.kv_memory_fraction, "must be in (0, 0.95]")
        if self.kv_memory_bytes is not None and self.kv_memory_fraction is not None:
            raise ConfigError(
                "kv_memory_fraction", self.kv_memory_fraction, "give kv_memory_bytes or kv_memory_fraction, not both"
            )
        if not (isinstance(self.max_batched_tokens, int) and self.max_batched_tokens >= 1):
            raise ConfigError("max_batched_tokens", self.max_batched_tokens, "must be an integer >= 1")
        for name in ("enforce_eager", "prefill_graphs", "async_scheduling"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, getattr(self, name), "must be True or False")
        if self.prefix_cache not in (None, True, False):
            raise ConfigError("prefix_cache", self.prefix_cache, "must be True, False or None (on in paged mode)")
        if self.prefix_cache and self.kv_mode not in PREFIX_CACHE_KV_MODES:
            raise ConfigError("prefix_cache", self.prefix_cache, "needs kv_mode='paged': a contiguous KV page holds a "
                              "whole sequence, so no page could ever be shared")
        if self.single_flight != "off" and not self.prefix_cache_enabled:
            raise ConfigError("single_flight", self.single_flight, "followers restore the leader's pages from the "
                              "prefix cache: turn prefix_cache on (kv_mode='paged') or set single_flight='off'")
        if isinstance(self.num_draft_tokens, bool) or not (
            isinstance(self.num_draft_tokens, int) and 1 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS
        ):
            raise ConfigError(
                "num_draft_tokens", self.num_draft_tokens, f"must be an integer in [1, {MAX_DRAFT_TOKENS}]"
            )
        if isinstance(self.tv_budget, bool) or not isinstance(self.tv_budget, (int, float)) \
                or not 0.0 <= self.tv_budget <= 1.0:
            raise ConfigError("tv_budget", self.tv_budget, "must be a number in [0, 1] (0 = lossless)")
        if self.draft_policy is None:
            self.draft_policy = "fixed"
        parse_draft_policy(self.draft_policy, self.num_draft_tokens)  # raises ConfigError naming the policy
        if not (isinstance(self.max_active_requests, int) and self.max_active_requests >= 1):
            raise ConfigError("max_active_requests", self.max_active_requests, "must be an integer >= 1")
        if isinstance(self.handoff_rows, bool) or not (isinstance(self.handoff_rows, int) and self.handoff_rows >= 0):
            raise ConfigError("handoff_rows", self.handoff_rows, "must be an integer >= 0 (default 0)")

    @property
    def max_rows(self) -> int:
        """The most requests a step can hold: every slot plus the handoff rows. The model
        runner's buffers and CUDA graphs, and the default KV pool, are sized for it."""
        return self.max_active_requests + self.handoff_rows

    @property
    def prefix_cache_enabled(self) -> bool:
        return self.kv_mode in PREFIX_CACHE_KV_MODES if self.prefix_cache is None else self.prefix_cache

    def kernel_options(self) -> KernelOptions:
        return KernelOptions(**self.kernel_settings())

    def kv_budget_bytes(self, device, max_model_len: int, page_bytes: int, page_size: int) -> int:
        """The KV pool's size in bytes on `device` (see kv_memory_bytes above)."""
        import torch

        if self.kv_memory_bytes is not None:
            return self.kv_memory_bytes
        if self.kv_memory_fraction is not None:
            if device.type != "cuda":
                raise ConfigError("kv_memory_fraction", self.kv_memory_fraction,
                                  "is a fraction of free GPU memory; on a CPU give kv_memory_bytes")
            return int(torch.cuda.mem_get_info(device)[0] * self.kv_memory_fraction)
        pages_per_seq = -(-max_model_len // page_size)
        # The CUDA graphs take one page as their scratch (padding rows write there): without
        # it counted, a pool sized for exactly one full-length request refuses that request.
        graph_scratch = 1 if device.type == "cuda" and not self.enforce_eager else 0
        wanted = (self.max_rows * pages_per_seq + graph_scratch) * page_bytes
        cap = int(torch.cuda.mem_get_info(device)[0] * 0.5) if device.type == "cuda" else _CPU_KV_CAP
        return max(page_bytes * (pages_per_seq + graph_scratch), min(wanted, cap))
