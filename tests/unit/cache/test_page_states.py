"""The pool's page states (`PagePool.page_states`, the snapshot's `kv.page_states`): the
five states the notebook's page map draws, on a real pool, prefix index and KV manager.

Reference: the holders counted by hand from the requests built here (which block tables
hold which page, and which pages were published to the prefix index).
"""

from __future__ import annotations

import torch

from minivllm.cache.kv_manager import KVManager
from minivllm.cache.page_pool import PAGE_STATES, PagePool
from minivllm.cache.prefix_index import PrefixIndex


class Owner:
    """The fields KVManager reads and writes on a request."""

    def __init__(self, ids: list[int], computed: int):
        self.all_ids = ids
        self.num_tokens = len(ids)
        self.num_computed = computed
        self.block_table: list[int] = []
        self.cache_keys: list[int] = []
        self.published_pages = 0


def test_the_five_page_states():
    assert PAGE_STATES == ("free", "owned", "cached-idle", "cached-in-use", "shared")
    pool = PagePool(n_layers=1, num_pages=10, page_size=2, n_kv_heads=1, head_dim=4, dtype=torch.float32,
                    device="cpu")
    kv = KVManager(pool, PrefixIndex(pool))
    # a: 5 tokens, 4 computed -> pages a0, a1 full and published, a2 owned.
    a = Owner([1, 2, 3, 4, 5], computed=4)
    assert kv.admit(a) == 0
    kv.publish(a)
    # b: same first 4 tokens -> restores a0, a1 (each now held by a, b and the index).
    b = Owner([1, 2, 3, 4, 9], computed=0)
    assert kv.admit(b) == 4
    # c: 3 tokens, 2 computed -> c0 published, then c finishes: c0 cached-idle.
    c = Owner([7, 7, 7], computed=2)
    assert kv.admit(c) == 0
    kv.publish(c)
    c_first = c.block_table[0]
    kv.free(c)
    # d: 3 tokens, 2 computed -> d0 published, d1 owned: d0 cached-in-use.
    d = Owner([8, 8, 8], computed=2)
    assert kv.admit(d) == 0
    kv.publish(d)
    states = pool.page_states()
    expected = ["free"] * pool.num_pages
    a0, a1, a2 = a.block_table
    expected[a0] = expected[a1] = "shared"  # a and b
    expected[a2] = "owned"
    expected[b.block_table[2]] = "owned"
    expected[c_first] = "cached-idle"
    expected[d.block_table[0]] = "cached-in-use"
    expected[d.block_table[1]] = "owned"
    assert b.block_table[:2] == [a0, a1]
    assert states == expected, (states, expected)
    assert pool.snapshot()["page_states"] == states
