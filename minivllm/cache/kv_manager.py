"""`KVManager`: which KV pages each request holds, for one `PagePool`.

The scheduler decides who runs; the KV manager decides which pages they get. It is the
only code that writes a block table: `request.block_table` for the target's pool (one
manager per engine, with the prefix cache when it is on) and `request.spec.block_table`
for the draft's pool (one manager per `Drafter`, no prefix cache). Callers ask:

    admit(req)                    pages for every known token, restoring the longest cached
                                  prefix of all_ids[:-1]; the restored tokens, or None
    allocate_slots(t, n, k)       pages for positions 0..n-1 (all or none), then for up to k
                                  lookahead positions (draft tokens) as far as pages are free
    truncate(t, n)                drop the pages past those holding positions 0..n-1
                                  (rejected draft tokens)
    free(t)                       drop every page (finish, abort, error, preemption)
    publish(req) / computed(req)  index the request's full computed pages in the prefix
                                  cache (always / when the publication policy is incremental)
    reserve_landing(ids) / land(r, n) / drop_landing(r)
                                  pages set aside for another worker's K/V of `ids` (a split
                                  request's decode half, cache/kv_transfer.py), then indexed
                                  once written, or given back

Invariants (tests/engine_invariants.py recomputes them after every step):
- a page's refcount is the number of block tables holding it plus one if the prefix
  index holds it (plus the CUDA graphs' scratch page, held by the graph runner);
- a block table never holds a page twice, and only cached pages are in several tables;
- nothing is half-done: `admit` and `allocate_slots` either take every page they need
  or none (a refused admission leaves the request and the pool as they were), and a
  table that loses pages releases them deepest first, the prefix cache's LRU order;
- every way out of the engine (finish, abort, error, preemption) ends in `free`, so no
  page outlives its request.

Who may call: the mutators (`MUTATORS`: every method that takes, drops or indexes pages)
are called by engine/scheduler.py alone, on the target's manager and on the draft pool's
(tests/unit/test_kv_writers.py checks the source); the rest read.

Single-flight needs nothing here: a follower is simply not admitted (the scheduler's
decision) until its leader has published the prompt's pages, which `admit` restores.
"""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.cache.page_pool import PagePool
from minivllm.cache.prefix_index import PrefixIndex

# The methods that change block tables, the pool or the prefix index.
MUTATORS = frozenset({"admit", "allocate_slots", "truncate", "free", "publish", "computed", "clear_cache", "adopt",
                      "reserve_landing", "land", "drop_landing"})


@dataclass
class Reservation:
    """Pages set aside for the K/V of `token_ids`, block by block: `held`, the leading
    blocks this prefix cache had already (one reference each), then `pages`, taken free for
    the next blocks (as many as fitted), to be written by another worker."""

    token_ids: list[int]
    keys: list[int]
    held: list[int]
    pages: list[int]

    @property
    def have(self) -> int:
        return len(self.held)

    @property
    def blocks(self) -> int:
        return len(self.held) + len(self.pages)


class KVManager:
    def __init__(self, pool: PagePool, prefix: PrefixIndex | None = None, *, publication: str = "incremental"):
        self.pool = pool
        self._prefix = prefix
        self.publication = publication  # "incremental" | "at_completion"

    @property
    def caching(self) -> bool:
        """Whether a prefix cache is attached (publication and restores happen)."""
        return self._prefix is not None

    # -- admission ---------------------------------------------------------------------------

    def admit(self, req) -> int | None:
        """Give a waiting request pages for every known token, restoring what the prefix
        cache has of `all_ids[:-1]` (at least one token is always computed, so there are
        logits to sample); returns the restored tokens, or None (nothing changed) if the
        pool cannot hold the rest now."""
        pool, index = self.pool, self._prefix
        hit = []
        if index is not None:
            lookup_ids = req.all_ids[:-1]
            hit = index.match(lookup_ids, index.keys_for(lookup_ids, req.cache_keys))
        needed = pool.pages_for(req.num_tokens) - len(hit)
        # Matched idle pages stop being evictable once shared, so they don't count twice.
        available = pool.num_available - (index.num_idle_among(hit) if hit else 0)
        if needed > available:
            return None
        shared = index.acquire(hit) if index is not None else []
        try:
            own = pool.allocate(needed, after=shared[-1] if shared else None)
        except BaseException:
            pool.release(shared[::-1])
            raise
        req.block_table = shared + own
        req.published_pages = len(hit)
        return len(hit) * pool.page_size

    # -- growing and shrinking a table ---------------------------------------------------------

    def allocate_slots(self, owner, n_tokens: int, lookahead: int = 0) -> int | None:
        """Pages for positions 0..n_tokens-1 of `owner.block_table`: all of them, or None and
        nothing taken when the pool cannot give them now. Then pages for up to `lookahead`
        further positions, only as far as pages are available now (speculation never
        preempts nor waits); returns how many lookahead positions are covered."""
        pool, table = self.pool, owner.block_table
        need = pool.pages_for(n_tokens) - len(table)
        if need > pool.num_available:
            return None
        if need > 0:
            table += pool.allocate(need, after=table[-1] if table else None)
        if lookahead <= 0:
            return 0
        spare = (len(table) + pool.num_available) * pool.page_size - n_tokens
        granted = min(lookahead, spare)
        if granted <= 0:
            return 0
        more = pool.pages_for(n_tokens + granted) - len(table)
        if more > 0:
            table += pool.allocate(more, after=table[-1] if table else None)
        return granted

    def truncate(self, owner, n_tokens: int) -> None:
        """Keep only the pages that hold positions 0..n_tokens-1 (rejected draft positions
        past them lose their pages)."""
        keep = self.pool.pages_for(n_tokens)
        table = owner.block_table
        if len(table) > keep:
            self.pool.release(table[keep:][::-1])
            del table[keep:]

    def free(self, owner) -> None:
        """Drop every page of `owner` (finish, abort, error, preemption)."""
        if owner.block_table:
            self.pool.release(owner.block_table[::-1])  # deepest first: the prefix cache's LRU order
            owner.block_table = []
        if self._prefix is not None:
            owner.published_pages = 0

    # -- publication -----------------------------------------------------------------------------

    def computed(self, req) -> None:
        """More of `req`'s K/V is complete: publish it now if the policy is incremental."""
        if self._prefix is not None and self.publication == "incremental":
            self.publish(req)

    def publish(self, req) -> None:
        """Index the request's full pages whose K/V are computed (committed tokens only:
        the pending last token has no K/V yet). A no-op without a prefix cache."""
        index = self._prefix
        if index is None:
            return
        ps = self.pool.page_size
        full = min(req.num_computed // ps, len(req.block_table))
        if full <= req.published_pages:
            return
        ids = req.all_ids
        keys = index.keys_for(ids[:full * ps], req.cache_keys)
        index.publish(ids, keys, req.block_table, req.published_pages, full)
        req.published_pages = full

    # -- pages from another worker (cache/kv_transfer.py) ----------------------------------------

    def adopt(self, blocks) -> int:
        """Publish another worker's full pages (`KVBlocks`) in this prefix cache, as if this
        pool had computed them: blocks already cached here are kept (theirs are the same
        tokens in the same context), the rest are written into free pages (this pool's
        dtype) and indexed, held by the index alone (cached-idle, evictable like any).
        Returns how many tokens were newly cached; 0 without a prefix cache or free pages."""
        from minivllm.cache.kv_transfer import check_blocks, write_page

        if self._prefix is None:
            return 0
        check_blocks(self.pool, blocks)
        reservation = self.reserve_landing(blocks.token_ids)
        for i, page in enumerate(reservation.pages):
            write_page(self.pool, page, blocks, reservation.have + i)
        return self.land(reservation, reservation.blocks)

    def reserve_landing(self, token_ids: list[int]) -> "Reservation":
        """Pages for the K/V of `token_ids` (whole pages) that another worker will write:
        the blocks this cache holds already are held (so no allocation evicts a page the
        chain will point at), free pages are taken for as many of the rest as fit. Nothing
        is indexed until `land`; `drop_landing` gives it all back."""
        index, pool = self._prefix, self.pool
        ps = pool.page_size
        ids = list(token_ids[:len(token_ids) // ps * ps])
        keys = index.keys_for(ids, []) if index is not None else []
        held = index.hold(index.match(ids, keys)) if index is not None else []
        pages: list[int] = []
        for _ in range(len(held), len(keys)):
            if pool.num_available < 1:
                break
            last = pages[-1] if pages else held[-1] if held else None
            pages.append(pool.allocate(1, after=last)[0])
        return Reservation(ids, keys, held, pages)

    def land(self, reservation: "Reservation", blocks: int) -> int:
        """The first `blocks` blocks of `reservation` hold their K/V now: index them (held
        by the index alone, cached-idle) and free the reserved pages past them. Returns the
        tokens newly cached."""
        r, ps, index = reservation, self.pool.page_size, self._prefix
        table = r.held + r.pages
        blocks = max(len(r.held), min(blocks, len(table)))
        # Blocks indexed since the reservation (another landing of a prompt with the same
        # start, as in a burst of splits sharing a system prompt) hold the same K/V as our
        # copies. Our copy of such a block would end the chain: publish keeps a duplicate's
        # deeper blocks private, and here nobody would hold them, so every block past it
        # would be freed and recomputed. Hold the indexed pages in their place instead.
        indexed = index.match(r.token_ids[:blocks * ps], r.keys)  # r.held first: held, never evicted
        start = max(len(indexed), len(r.held))
        if len(indexed) > len(r.held):
            ours = table[len(r.held):start]
            table = r.held + index.hold(indexed[len(r.held):]) + table[start:]
            self.pool.release(ours[::-1])
        added = index.publish(r.token_ids, r.keys, table, start, blocks) if blocks > start else 0
        self.pool.release(table[::-1])  # the unwritten tail is freed, the rest stays indexed
        r.pages, r.held = [], []
        return added * ps

    def drop_landing(self, reservation: "Reservation") -> None:
        """Give a reservation's pages back unwritten (its cached blocks stay cached)."""
        self.pool.release((reservation.held + reservation.pages)[::-1])
        reservation.pages, reservation.held = [], []

    # -- the prefix cache as a whole -----------------------------------------------------------

    def cached_prefix_tokens(self, prompt_ids: list[int]) -> int:
        """How many leading tokens of this prompt admission could restore now.

        Safe from another thread while the engine steps: the lookup only reads dicts
        (atomic under the GIL), so the worst case is a slightly stale answer, which is
        all a routing estimate needs."""
        index = self._prefix
        if index is None or not prompt_ids:
            return 0
        try:
            blocks = index.match(prompt_ids, index.keys_for(prompt_ids, []))
        except Exception:  # noqa: BLE001 - an estimate; never fail a route over it
            return 0
        # The engine always computes at least the last prompt token (its logits start decode).
        return min(len(blocks) * index.page_size, len(prompt_ids) - 1)

    def clear_cache(self) -> int:
        """Evict every idle cached page (pages in use stay indexed); returns how many."""
        return self._prefix.clear() if self._prefix is not None else 0

    def reset_counters(self) -> None:
        """Zero the prefix cache's counters."""
        if self._prefix is not None:
            self._prefix.counters = dict.fromkeys(self._prefix.counters, 0)

    def describe_cache(self) -> dict:
        """The prefix index's `snapshot()` section, or zeros when there is none."""
        if self._prefix is None:
            return dict(_EMPTY_INDEX)
        return self._prefix.snapshot()

    def cache_contents(self) -> dict:
        """A copy of what the prefix index holds, for checks: `blocks` {key: (parent_key,
        page, n_tokens)}, `pages` {page: key} and `idle` (pages held by the index alone,
        least recently used first). Empty without a prefix cache."""
        index = self._prefix
        if index is None:
            return {"blocks": {}, "pages": {}, "idle": []}
        return {"blocks": {k: (b.parent_key, b.page, len(b.tokens)) for k, b in index.blocks.items()},
                "pages": {p: b.key for p, b in index.page_block.items()},
                "idle": index.idle_pages()}


_EMPTY_INDEX = {"cached_pages": 0, "idle_pages": 0, "in_use_pages": 0, "cached_tokens": 0, "lookups": 0, "hits": 0,
                "restored_tokens": 0, "published_pages": 0, "duplicate_pages": 0, "evicted_pages": 0, "hit_rate": 0.0}
