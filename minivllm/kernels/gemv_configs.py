"""Launch shapes of the tiled decode GEMV (`kernels/triton/tiled_gemv.py`), per GPU.

`gemv_configs.json` beside this file holds, per profile key ("sm90", "sm75", ... from
`gpu_profile.py`), the configuration that `scripts/gemv_sweep.py` measured fastest for
each (type, N, K) on that GPU, for the float kernel ("configs") and the int8-activation
one ("configs_int8"), with the device and date it ran on. A shape that is not in
the table takes the row of the nearest measured N of its type and K (within a factor of
4: fused projections, `kernels/fused_projection.py`), else `default_config`: enough
programs for every SM, split-K for narrow matrices.

A configuration depends on (profile, type, N, K) only, never on the number of activation
rows: that is what keeps batch-invariant mode bit-identical with one launch shape.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

TABLE_PATH = Path(__file__).with_name("gemv_configs.json")
TABLE_ENV = "MINIVLLM_GEMV_CONFIGS"  # another table file (a sweep's output, before it is committed)
# Which decode GEMV runs where several could: "tiled" (default), "legacy" (the
# one-row-group kernel, repacked_gemv.py), "mma" (mma_gemv.py: Q4_K with f16 activations).
# (A persistent kernel, a fixed grid walking the tiles, was a choice until h100-s56: it lost
# at every 7B shape in the sweep and decoded 72.9 tok/s against the tiled 344.4; removed.)
GEMV_KERNEL_ENV = "MINIVLLM_GEMV_KERNEL"


@dataclass(frozen=True)
class GemvConfig:
    block_nb: int = 4  # row groups (of 4 rows) per program
    block_g: int = 32  # 32-element groups of K per loop trip
    split: int = 1  # slices of K (fixed-order reduction when > 1)
    num_warps: int = 4
    num_stages: int = 2
    t_outer: bool = False  # the tile's T axis outermost (tiled_gemv.gemv_trip_t_outer); not for gate+up

    def as_dict(self) -> dict:
        return asdict(self)


def shape_key(type_name: str, n: int, k: int) -> str:
    return f"{type_name}:{n}x{k}"


@lru_cache(maxsize=None)
def _table() -> dict:
    path = Path(os.environ.get(TABLE_ENV) or TABLE_PATH)
    if not path.is_file():
        return {}
    return json.loads(path.read_text())


def reload_table() -> None:
    """Forget the loaded table and every lookup made from it, so the next lookup reads
    `TABLE_ENV` (or the committed file) again: a sweep, or a test pointing at its own table."""
    _table.cache_clear()
    lookup.cache_clear()


def default_config(n: int, k: int, sm_count: int = 132) -> GemvConfig:
    """A shape the sweep has not measured: 4 row groups per program when that still gives
    every SM two programs, else one; then split K until there are about 2 programs per SM
    (each slice at least one loop trip)."""
    n_rb = -(-n // 4)
    groups = k // 32
    nb = 4 if n_rb // 4 >= 2 * sm_count else 1
    block_g = 32
    tiles = -(-n_rb // nb)
    split = 1
    while tiles * split < 2 * sm_count and groups // (split * 2) >= block_g:
        split *= 2
    return GemvConfig(block_nb=nb, block_g=block_g, split=split)


# How far (as a ratio of N) a measured shape's configuration still stands in for an
# unmeasured one of the same type and K: a fused QKV (4608 x 3584) takes the 3584 x 3584
# row's, a fused gate+up (37888 x 3584) the 18944 x 3584 row's.
NEAREST_N_RATIO = 4.0


def nearest_entry(section: dict, type_name: str, n: int, k: int) -> tuple[str, dict] | None:
    """The measured (key, entry) of this type and K whose N is nearest to `n` on a log
    scale (ties: the larger N), if within NEAREST_N_RATIO; else None."""
    best = None
    for key, entry in section.items():
        t, shape = key.split(":")
        rows, cols = (int(v) for v in shape.split("x"))
        if t != type_name or cols != k or not (1 / NEAREST_N_RATIO <= rows / n <= NEAREST_N_RATIO):
            continue
        distance = (abs(math.log(rows / n)), -rows)
        if best is None or distance < best[0]:
            best = (distance, key, entry)
    return None if best is None else (best[1], best[2])


@lru_cache(maxsize=None)
def lookup(table_key: str, type_name: str, n: int, k: int, sm_count: int = 132, *, int8: bool = False) -> GemvConfig:
    """The table's configuration for the float kernel (or the int8 one: `int8=True`): the
    shape's own row, else the nearest measured N of that type and K (fused projections
    the sweep has not measured yet), else `default_config`."""
    section = _table().get(table_key, {}).get("configs_int8" if int8 else "configs", {})
    entry = section.get(shape_key(type_name, n, k))
    if entry is None:
        near = nearest_entry(section, type_name, n, k)
        if near is None:
            return default_config(n, k, sm_count)
        entry = near[1]
    return GemvConfig(**entry)
