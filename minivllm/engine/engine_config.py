"""Engine settings, validated once at construction with errors that name the field."""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.errors import ConfigError
from minivllm.kernels.kernel_options import KernelOptions
from minivllm.spec.draft_policy import MAX_DRAFT_TOKENS, parse_draft_policy

KV_MODES = ("paged", "contiguous")
POLICIES = ("fcfs", "shortest-prefill-first", "round-robin")
PUBLICATIONS = ("at_completion", "incremental")
SINGLE_FLIGHT = ("off", "at_completion", "after_prefill")
_CPU_KV_CAP = 1 << 30


@dataclass
class EngineConfig:
    kv_mode: str = "paged"
    page_size: int = 16
    # KV pool budget: bytes, or a fraction of free GPU memory. Neither: enough for
    # max_active_requests full-length sequences, capped at 1 GiB on CPU and at half of
    # the free memory on a GPU.
    kv_memory_bytes: int | None = None
    kv_memory_fraction: float | None = None
    max_model_len: int | None = None  # default: min(model context, 4096)
    max_batched_tokens: int = 512  # per-step token budget (decode rows + prefill chunks)
    max_active_requests: int = 16
    policy: str = "fcfs"
    # Kernel choices (see kernels/kernel_options.py): rows up to gemv_max_rows take the
    # fused dequantize-GEMV path (None: the device default; 0: never); dequant_cache keeps
    # dense copies for GEMM; batch_invariant makes each row's arithmetic independent of the
    # batch; enforce_eager turns CUDA graphs off.
    gemv_max_rows: int | None = None
    dequant_cache: bool | str = "auto"
    batch_invariant: bool = False
    # What a CPU GEMV runs (kernel_options.CPU_GEMV_MODES): "auto" keeps float32 activations
    # and accumulation for a float32 model and takes the low-precision packs ("lowp") only
    # when the activation dtype is bfloat16.
    cpu_gemv: str = "auto"
    enforce_eager: bool = False
    # Prefix cache (cache/prefix_index.py). None: on in paged mode, off in contiguous mode
    # (a page there is a whole sequence, so nothing could be shared). publication says
    # when a request's full pages become reusable: "incremental" after every forward
    # that completes one, "at_completion" when the request finishes. single_flight makes
    # requests with identical input ids wait for one leader (cache/flight_coordinator.py)
    # and release them "at_completion" of the leader or "after_prefill".
    prefix_cache: bool | None = None
    publication: str = "incremental"
    single_flight: str = "off"
    # Speculative decoding (minivllm/spec/), used when the engine is given a draft model:
    # draft_policy picks each request's proposal length (spec/draft_policy.py; None means
    # "fixed"), num_draft_tokens is its k (fixed) or starting k (adaptive), and tv_budget
    # is mentored decoding's total-variation budget D (0 = lossless, 1 = accept every
    # draft token; greedy requests ignore it).
    draft_policy: str | None = None
    num_draft_tokens: int = 4
    tv_budget: float = 0.0

    def __post_init__(self) -> None:
        if self.kv_mode not in KV_MODES:
            raise ConfigError("kv_mode", self.kv_mode, f"allowed: {', '.join(KV_MODES)}")
        if self.policy not in POLICIES:
            raise ConfigError("policy", self.policy, f"allowed: {', '.join(POLICIES)}")
        if not (isinstance(self.page_size, int) and self.page_size >= 1):
            raise ConfigError("page_size", self.page_size, "must be an integer >= 1 (default 16)")
        if self.kv_memory_bytes is not None and self.kv_memory_bytes <= 0:
            raise ConfigError("kv_memory_bytes", self.kv_memory_bytes, "must be > 0")
        if self.kv_memory_fraction is not None and not 0 < self.kv_memory_fraction <= 0.95:
            raise ConfigError("kv_memory_fraction", self.kv_memory_fraction, "must be in (0, 0.95]")
        if self.kv_memory_bytes is not None and self.kv_memory_fraction is not None:
            raise ConfigError("kv_memory_fraction", self.kv_memory_fraction, "give kv_memory_bytes or kv_memory_fraction, not both")
        if not (isinstance(self.max_batched_tokens, int) and self.max_batched_tokens >= 1):
            raise ConfigError("max_batched_tokens", self.max_batched_tokens, "must be an integer >= 1")
        if not isinstance(self.enforce_eager, bool):
            raise ConfigError("enforce_eager", self.enforce_eager, "must be True or False")
        if self.prefix_cache not in (None, True, False):
            raise ConfigError("prefix_cache", self.prefix_cache, "must be True, False or None (on in paged mode)")
        if self.prefix_cache and self.kv_mode == "contiguous":
            raise ConfigError("prefix_cache", self.prefix_cache, "needs kv_mode='paged': a contiguous KV page holds a "
                              "whole sequence, so no page could ever be shared")
        if self.publication not in PUBLICATIONS:
            raise ConfigError("publication", self.publication, f"allowed: {', '.join(PUBLICATIONS)}")
        if self.single_flight not in SINGLE_FLIGHT:
            raise ConfigError("single_flight", self.single_flight, f"allowed: {', '.join(SINGLE_FLIGHT)}")
        if self.single_flight != "off" and not self.prefix_cache_enabled:
            raise ConfigError("single_flight", self.single_flight, "followers restore the leader's pages from the "
                              "prefix cache: turn prefix_cache on (kv_mode='paged') or set single_flight='off'")
        if isinstance(self.num_draft_tokens, bool) or not (isinstance(self.num_draft_tokens, int) and 1 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS):
            raise ConfigError("num_draft_tokens", self.num_draft_tokens, f"must be an integer in [1, {MAX_DRAFT_TOKENS}]")
        if isinstance(self.tv_budget, bool) or not isinstance(self.tv_budget, (int, float)) \
                or not 0.0 <= self.tv_budget <= 1.0:
            raise ConfigError("tv_budget", self.tv_budget, "must be a number in [0, 1] (0 = lossless)")
        if self.draft_policy is None:
            self.draft_policy = "fixed"
        parse_draft_policy(self.draft_policy, self.num_draft_tokens)  # raises ConfigError naming the policy
        self.kernel_options()  # validates gemv_max_rows, dequant_cache, batch_invariant, cpu_gemv
        if not (isinstance(self.max_active_requests, int) and self.max_active_requests >= 1):
            raise ConfigError("max_active_requests", self.max_active_requests, "must be an integer >= 1")

    @property
    def prefix_cache_enabled(self) -> bool:
        return self.kv_mode == "paged" if self.prefix_cache is None else self.prefix_cache

    def kernel_options(self) -> KernelOptions:
        return KernelOptions(gemv_max_rows=self.gemv_max_rows, dequant_cache=self.dequant_cache,
                             batch_invariant=self.batch_invariant, cpu_gemv=self.cpu_gemv)

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
        wanted = (self.max_active_requests * pages_per_seq + graph_scratch) * page_bytes
        cap = int(torch.cuda.mem_get_info(device)[0] * 0.5) if device.type == "cuda" else _CPU_KV_CAP
        return max(page_bytes * (pages_per_seq + graph_scratch), min(wanted, cap))
