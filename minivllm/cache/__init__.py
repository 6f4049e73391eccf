"""KV storage for requests. The contiguous cache is the reference; paged comes next.

How the package works (the design notes that ARCHITECTURE.md used to carry):

`PagePool`: one K and one V tensor of shape (layers, pages, page_size, kv_heads,
head_dim), sized once from a memory budget, with reference-counted pages and a per-page
state array (free / owned / shared / cached-idle); `num_available` counts free plus
cached-idle pages, and `allocate` evicts idle cached pages when it runs out of free
ones. `PrefixIndex`: full pages keyed by `hash((parent key, page tokens))`, verified on
lookup (a collision is a miss); it holds one reference per indexed page, so a page
nobody uses stays cached-idle; idle pages form an LRU list in which a child always
precedes its parent (requests release their block tables deepest page first), so
eviction only ever removes leaves. `KVManager` (one per pool: the target's, which owns
the prefix index, and the draft's, without one) is the only writer of block tables:
`admit` (prefix restore; all pages or none), `allocate_slots(owner, n, lookahead)`
(positions 0..n-1 or nothing, then up to `lookahead` draft positions from pages
available now), `truncate`, `free`, `publish`/`computed` (the publication policy) and
`cached_prefix_tokens`; its docstring states the refcount invariants.
`FlightCoordinator`: requests with identical input ids form a flight (leader +
followers); a flight is deleted when released (at the leader's completion or after its
prefill), and released ids move to one flat set until they end, so an unknown id is
still an error; a leader that ends before its prompt is ready promotes its oldest
follower. The `contiguous` KV mode is the same pool with `page_size == max_model_len`,
so each request holds one page. `PagedBatchKV` is one step's KV view: index tensors are
built once per step, K/V are written once per layer (one Triton launch on CUDA, or by the
fused RoPE kernel; `index_copy_` on CPU), and each
request attends to its own pages (on CPU, SDPA over slices of consecutive pages; on
CUDA, decode rows go to the Triton paged-attention kernel, prefill chunks to SDPA;
`invariant=True` sends every row through a per-row path). `PagedBatchKV.static_decode`
builds the same view over caller-owned buffers for CUDA graphs. `ContiguousKVCache` is
the single-sequence reference that tests compare against
"""
