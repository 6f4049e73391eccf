"""A fixed pool of KV pages shared by every request of one engine.

Storage is one tensor per K and V of shape (layers, pages, page_size, kv_heads, head_dim),
allocated once from a memory budget, so the engine never allocates KV memory per step.
Pages are reference-counted. A request holds one reference on each page of its block
table; the prefix cache (`prefix_index.py`), when attached, holds one more on each page
it indexes, so several requests can share a page and a page nobody uses can stay
cached-idle until `allocate` needs it back (then the cache evicts its least recently
used idle pages).

The `contiguous` KV mode is this same pool with `page_size == max_model_len`: every
request then holds exactly one page, and attention reads it as a plain slice.
"""

from __future__ import annotations

import torch

from minivllm.errors import ConfigError, MinivllmError


class OutOfPagesError(MinivllmError):
    """Raised by `allocate` when the pool cannot satisfy a request; the scheduler
    checks `num_free` first, so seeing this means a scheduler bug, not user error."""


# Per-page states reported in snapshots (what the notebook's page map draws).
FREE, OWNED, CACHED_IDLE, CACHED_IN_USE, SHARED = "free", "owned", "cached-idle", "cached-in-use", "shared"
PAGE_STATES = (FREE, OWNED, CACHED_IDLE, CACHED_IN_USE, SHARED)


class PagePool:
    def __init__(self, *, n_layers: int, num_pages: int, page_size: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, shareable: bool = False):
        """`shareable`: a CPU pool in memory another local worker can map and write into
        (cache/shared_pool_memory.py); `self.shared` then describes it, else it is None."""
        if num_pages < 1:
            raise ConfigError("kv_num_pages", num_pages, "the KV memory budget must hold at least one page; "
                              "raise kv_memory_bytes / kv_memory_fraction or lower max_model_len / page_size")
        shape = (n_layers, num_pages, page_size, n_kv_heads, head_dim)
        self.shared = None
        if shareable and torch.device(device).type == "cpu":
            from minivllm.cache.shared_pool_memory import SharedPoolMemory

            self.shared = SharedPoolMemory(shape, dtype)  # zero-filled, like torch.zeros
            self.k, self.v = self.shared.k, self.shared.v
        else:
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_pages = num_pages
        self.page_size = page_size
        self.refcount = [0] * num_pages
        self._free: set[int] = set(range(num_pages))
        self.cache = None  # the PrefixIndex holding references on cached pages, if any

    def attach_cache(self, cache) -> None:
        self.cache = cache

    @staticmethod
    def page_bytes(*, n_layers: int, page_size: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * n_layers * page_size * n_kv_heads * head_dim * elem

    # -- allocation ------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_available(self) -> int:
        """Pages `allocate` can hand out: free ones plus cached-idle ones it may evict."""
        return len(self._free) + (self.cache.num_idle if self.cache is not None else 0)

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def allocate(self, n: int, *, after: int | None = None) -> list[int]:
        """Take `n` free pages, preferring consecutive ones (right after page `after`
        when given), so that attention can read a request's pages as a few slices of
        the pool instead of gathering them."""
        if n > len(self._free) and self.cache is not None:
            self.cache.evict(n - len(self._free))
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} KV pages, {len(self._free)} free of {self.num_pages}")
        start = after + 1 if after is not None and after + 1 in self._free else self._first_run(n)
        pages = []
        p = start
        while len(pages) < n:
            if p not in self._free:
                p = min(self._free)
            pages.append(p)
            self._free.discard(p)
            p += 1
        for p in pages:
            self.refcount[p] = 1
        return pages

    def _first_run(self, n: int) -> int:
        """The lowest page starting a run of n free pages, else the lowest free page."""
        run_start, run = -1, 0
        for p in sorted(self._free):
            run_start, run = (run_start, run + 1) if p == run_start + run else (p, 1)
            if run == n:
                return run_start
        return min(self._free)

    def retain(self, pages: list[int]) -> None:
        """One more holder for pages that are already in use or cached."""
        for p in pages:
            if self.refcount[p] <= 0:
                raise RuntimeError(f"KV page {p} is free; only a page in use or cached can be shared")
            self.refcount[p] += 1

    def release(self, pages: list[int]) -> None:
        """Drop one reference per page. Release a block table deepest page first, so the
        prefix cache sees children turn idle before their parents (its LRU order)."""
        for p in pages:
            if self.refcount[p] <= 0:
                raise RuntimeError(f"KV page {p} released more often than it was taken")
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self._free.add(p)
            elif self.refcount[p] == 1 and self.cache is not None and self.cache.holds(p):
                self.cache.page_became_idle(p)

    # -- inspection ------------------------------------------------------------------

    def page_states(self) -> list[str]:
        """One of PAGE_STATES per page, by its request holders (its ref count less the
        prefix cache's one): free = no holder; owned = one request, not cached;
        cached-idle = the prefix cache alone (evictable); cached-in-use = cached and one
        request; shared = two or more requests."""
        cache = self.cache
        states = []
        for p, r in enumerate(self.refcount):
            cached = cache is not None and cache.holds(p)
            users = r - cached
            states.append(FREE if r == 0 else SHARED if users > 1 else
                          (CACHED_IN_USE if users else CACHED_IDLE) if cached else OWNED)
        return states

    def snapshot(self) -> dict:
        states = self.page_states()
        return {
            "page_size": self.page_size,
            "total_pages": self.num_pages,
            "free_pages": self.num_free,
            "available_pages": self.num_available,
            "used_pages": self.num_pages - self.num_free,
            "page_states": states,
            "ref_counts": list(self.refcount),
            "bytes": self.k.numel() * self.k.element_size() * 2,
        }
