"""The prefix cache: full KV pages indexed by a hash chain over their token ids.

A page is a block of `page_size` token positions. Block i of a sequence gets the key
`chain_key(key of block i-1, tokens of block i)`, so a block's key names its whole
context: [3, 4] after [8, 9] never matches [3, 4] after [1, 2]. The key is a plain
Python hash, so a lookup also checks the stored parent key and tokens: a collision is a
miss, never wrong K/V. Only full pages are indexed; a sequence's tail is never shared.

Ownership: the index holds one reference on every page it indexes (`PagePool.retain`),
each request using the page holds another. A page held by the index alone is
*cached-idle*: it keeps its K/V for a future hit and is evicted, least recently used
first, when the pool runs out of free pages. A page any request holds is never evicted.

LRU order. `_idle` lists idle pages oldest first. A page becomes idle when its last
request lets go of it; requests release their block tables deepest page first, and every
request holding a page also holds that page's ancestors, so a block always turns idle no
later than its parent and sits before it in `_idle`. Evicting from the front therefore
always removes a leaf of the cached tree, and a chain is never cut in the middle.

The index does not decide *when* to publish (see the engine's publication policy) nor
who waits for whom (`flight_coordinator.py`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from minivllm.cache.page_pool import PagePool

ROOT_KEY = 0  # the parent key of a sequence's first block


def chain_key(parent_key: int, tokens: tuple[int, ...]) -> int:
    return hash((parent_key, tokens))


@dataclass
class CachedBlock:
    key: int
    parent_key: int
    tokens: tuple[int, ...]
    page: int


class PrefixIndex:
    def __init__(self, pool: PagePool):
        self.pool = pool
        self.page_size = pool.page_size
        self.blocks: dict[int, CachedBlock] = {}  # key -> block
        self.page_block: dict[int, CachedBlock] = {}  # page id -> block
        self._idle: OrderedDict[int, None] = OrderedDict()  # pages held only by the index, LRU first
        self.counters = {"lookups": 0, "hits": 0, "restored_tokens": 0, "published_pages": 0,
                         "duplicate_pages": 0, "evicted_pages": 0}
        pool.attach_cache(self)

    # -- keys ---------------------------------------------------------------------------

    def keys_for(self, token_ids: list[int], known: list[int]) -> list[int]:
        """Chain keys of every full block of `token_ids`, extending `known` (the keys
        already computed for a prefix of the same sequence) so a request hashes each of
        its blocks once."""
        ps = self.page_size
        keys = known
        for i in range(len(keys), len(token_ids) // ps):
            parent = keys[i - 1] if i else ROOT_KEY
            keys.append(chain_key(parent, tuple(token_ids[i * ps:(i + 1) * ps])))
        return keys

    # -- lookup -------------------------------------------------------------------------

    def match(self, token_ids: list[int], keys: list[int]) -> list[CachedBlock]:
        """The cached blocks that continue `token_ids` from its start, up to the first
        miss. `keys` must be `keys_for(token_ids)` (or longer). Read-only: nothing is
        retained or counted, because admission may still fail for lack of pages."""
        ps = self.page_size
        found: list[CachedBlock] = []
        parent = ROOT_KEY
        for i in range(len(token_ids) // ps):
            block = self.blocks.get(keys[i])
            if block is None or block.parent_key != parent or block.tokens != tuple(token_ids[i * ps:(i + 1) * ps]):
                break
            found.append(block)
            parent = block.key
        return found

    def hold(self, blocks: list[CachedBlock]) -> list[int]:
        """Take a reference on each block's page (no longer idle, so never evicted until
        released) and return the pages; counts nothing."""
        pages = [b.page for b in blocks]
        for p in pages:
            self._idle.pop(p, None)
        self.pool.retain(pages)
        return pages

    def num_idle_among(self, blocks: list[CachedBlock]) -> int:
        return sum(1 for b in blocks if b.page in self._idle)

    def acquire(self, blocks: list[CachedBlock]) -> list[int]:
        """Take a reference on each matched block's page for a request being admitted,
        count the lookup, and return the pages (the start of its block table)."""
        pages = self.hold(blocks)
        self.counters["lookups"] += 1
        self.counters["hits"] += bool(blocks)
        self.counters["restored_tokens"] += len(blocks) * self.page_size
        return pages

    # -- publication --------------------------------------------------------------------

    def publish(self, token_ids: list[int], keys: list[int], block_table: list[int], start: int, end: int) -> int:
        """Index blocks [start, end) of a running request, whose K/V are complete in
        `block_table[start:end]`. A block someone else already published is skipped (the
        request keeps its own copy private). Returns how many pages were newly indexed."""
        ps = self.page_size
        added = 0
        for i in range(start, end):
            if i and block_table[i - 1] not in self.page_block:
                # This request's previous block was a duplicate: the indexed parent is
                # another page it does not hold, which could turn idle and be evicted
                # before this block, cutting the chain. Its deeper blocks stay private.
                break
            key = keys[i]
            if key in self.blocks:
                self.counters["duplicate_pages"] += 1
                continue
            page = block_table[i]
            if page in self.page_block:  # already indexed under another key: impossible unless a bug
                raise RuntimeError(f"KV page {page} is already indexed for another block")
            block = CachedBlock(key, keys[i - 1] if i else ROOT_KEY, tuple(token_ids[i * ps:(i + 1) * ps]), page)
            self.blocks[key] = block
            self.page_block[page] = block
            self.pool.retain([page])
            added += 1
        self.counters["published_pages"] += added
        return added

    # -- idle pages and eviction ------------------------------------------------------------

    def holds(self, page: int) -> bool:
        return page in self.page_block

    def page_became_idle(self, page: int) -> None:
        """Called by the pool when only the index still references `page`."""
        self._idle[page] = None

    def idle_pages(self) -> list[int]:
        """Pages held by the index alone, least recently used first."""
        return list(self._idle)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def evict(self, n: int) -> int:
        """Drop up to `n` least recently used idle blocks, freeing their pages."""
        done = 0
        while done < n and self._idle:
            page, _ = self._idle.popitem(last=False)
            block = self.page_block.pop(page)
            del self.blocks[block.key]
            self.pool.release([page])
            done += 1
        self.counters["evicted_pages"] += done
        return done

    def clear(self) -> int:
        """Evict every idle block (pages in use stay indexed)."""
        return self.evict(len(self._idle))

    # -- inspection ---------------------------------------------------------------------

    def snapshot(self) -> dict:
        return {
            "cached_pages": len(self.page_block),
            "idle_pages": len(self._idle),
            "in_use_pages": len(self.page_block) - len(self._idle),
            "cached_tokens": len(self.page_block) * self.page_size,
            **self.counters,
            "hit_rate": self.counters["hits"] / self.counters["lookups"] if self.counters["lookups"] else 0.0,
        }
