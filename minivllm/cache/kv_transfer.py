"""K/V pages leaving one worker's pool and entering another's (issue 43: prefill here,
decode there).

What travels is `KVBlocks`: the K/V of a token prefix's *full* pages, as plain tensors
(layers × tokens × KV heads × head dim), with the token ids they belong to and the shape
of the model that computed them. The importer does not hand them to a request directly:
it writes them into free pages of its own pool, in its own dtype and page size, and
publishes them in its prefix cache under the same chain keys its own prefill would have
given them (`KVManager.adopt`). The request then enters the importer like any other, and
admission restores those pages: the partial last page and the last token are computed
there (a page's worth at most), so the decode's first forward has exact positions,
slots and logits, and every rule of the prefix cache (sharing, eviction, publication)
holds for imported pages too.

A mismatch of model shape, page tokens or K/V shape is refused with an error naming it:
imported pages must be what this model would have computed for these tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.errors import ConfigError


@dataclass
class KVBlocks:
    token_ids: list[int]  # the tokens whose K/V these are: a whole number of the exporter's pages
    k: torch.Tensor  # (n_layers, len(token_ids), n_kv_heads, head_dim)
    v: torch.Tensor
    shape: tuple[int, int, int]  # (n_layers, n_kv_heads, head_dim) of the model that computed them

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def blocks(self) -> "KVBlocks":
        return self

    def to(self, device, dtype: torch.dtype | None = None, *, non_blocking: bool = False) -> "KVBlocks":
        """The same blocks on `device` (in `dtype`): the transport's copy."""
        dtype = dtype or self.k.dtype
        return KVBlocks(list(self.token_ids), self.k.to(device, dtype, non_blocking=non_blocking),
                        self.v.to(device, dtype, non_blocking=non_blocking), self.shape)


@dataclass
class PageSpan:
    """`token_ids`' K/V still in the exporter's `pool`, one page of `pages` per page of
    tokens: what a transport copies from, once, to wherever the K/V go (a segment, or the
    importer's own pages). Valid only while the request holding those pages does."""

    pool: object
    pages: list[int]
    token_ids: list[int]

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        k = self.pool.k
        return 2 * self.n_tokens * k[:, 0, 0].numel() * k.element_size()

    def blocks(self) -> KVBlocks:
        """The K/V copied out of the pool (its device and dtype)."""
        return read_blocks(self.pool, self.pages, self.token_ids)


@dataclass
class LandedBlocks:
    """K/V another worker wrote straight into this pool's reserved pages (`reserve_import`):
    the first `blocks` blocks of `token_ids`."""

    token_ids: list[int]
    blocks: int

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)


def dtype_named(name: str, field: str) -> torch.dtype:
    """The torch dtype a message names ("float16"), or a ConfigError naming `field`."""
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(field, name, "a torch dtype name such as float32, float16, bfloat16")
    return dtype


def pool_shape(pool) -> tuple[int, int, int]:
    n_layers, _, _, kvh, d = pool.k.shape
    return (n_layers, kvh, d)


def read_blocks(pool, block_table: list[int], token_ids: list[int]) -> KVBlocks:
    """The K/V of `token_ids` (a whole number of pages, computed) from the pages of
    `block_table`, copied out of the pool (the pool's dtype, on its device)."""
    ps = pool.page_size
    if len(token_ids) % ps or len(token_ids) // ps > len(block_table):
        raise ValueError(f"read_blocks: {len(token_ids)} tokens are not whole pages of {ps} in this table")
    pages = torch.tensor(block_table[:len(token_ids) // ps], dtype=torch.long, device=pool.k.device)
    n_layers, _, _, kvh, d = pool.k.shape
    k = pool.k[:, pages].reshape(n_layers, len(token_ids), kvh, d)
    v = pool.v[:, pages].reshape(n_layers, len(token_ids), kvh, d)
    return KVBlocks(list(token_ids), k, v, pool_shape(pool))  # indexing by a page list already copied


def check_blocks(pool, blocks: KVBlocks) -> None:
    """Refuse blocks this pool's model could not have computed, naming what differs."""
    if tuple(blocks.shape) != pool_shape(pool):
        raise ConfigError("KV blocks", f"(layers, KV heads, head dim) = {tuple(blocks.shape)}",
                          f"this worker's model has {pool_shape(pool)}: import only from a worker of the same model")
    want = (blocks.shape[0], blocks.n_tokens, blocks.shape[1], blocks.shape[2])
    if tuple(blocks.k.shape) != want or tuple(blocks.v.shape) != want:
        raise ConfigError("KV blocks", f"k {tuple(blocks.k.shape)}, v {tuple(blocks.v.shape)}",
                          f"expected {want} for {blocks.n_tokens} tokens")
    if blocks.n_tokens % pool.page_size:
        raise ConfigError("KV blocks", f"{blocks.n_tokens} tokens",
                          f"a whole number of this pool's pages of {pool.page_size}")


def write_page(pool, page: int, blocks: KVBlocks, block: int) -> None:
    """Block `block` of `blocks` (page_size tokens) into pool page `page`, in the pool's
    dtype: one copy_, which converts the dtype and crosses devices on the way."""
    ps = pool.page_size
    sl = slice(block * ps, (block + 1) * ps)
    pool.k[:, page].copy_(blocks.k[:, sl])
    pool.v[:, page].copy_(blocks.v[:, sl])
