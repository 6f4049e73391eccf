"""The KV page map: one cell per page, coloured by what holds it.

States: the engine snapshot's `page_states` (`minivllm.cache.page_pool.PAGE_STATES`,
defined there once), drawn as they come:

| state | meaning |
|---|---|
| free | no holder |
| owned | one request, not in the prefix cache |
| cached-idle | in the prefix cache, no request uses it (evictable) |
| cached-in-use | in the prefix cache and used by one request (published, not yet reused) |
| shared | used by two or more requests at once (darker = more holders) |

A shared page's shade reads how many requests hold it: its ref count less the prefix
index's one reference (only the index adds holders to a page).

A page is one byte on the wire (`page_codes`): 0 free, 1 owned, 2 cached-idle,
3 cached-in-use, 2 + holders for shared (4 = two holders, capped at 255). The live widget
sends those bytes (10 KB at 10,000 pages) and the browser paints them on a canvas
(`page_map_widget.py`); the static fallback draws the same layout as a PNG written with
zlib alone (no imaging library needed).
"""

from __future__ import annotations

import base64
import math
import struct
import zlib

import numpy as np

from minivllm.cache.page_pool import PAGE_STATES

FREE, OWNED, CACHED_IDLE, CACHED_IN_USE, SHARED2 = 0, 1, 2, 3, 4
STATES = PAGE_STATES  # code i < SHARED2 is STATES[i]; codes >= SHARED2 are "shared"

# state -> RGB; shared pages get darker with more holders.
COLOURS = {
    "free": (235, 237, 240),
    "owned": (66, 133, 244),
    "cached-idle": (251, 188, 5),
    "cached-in-use": (0, 172, 193),
    "shared": (52, 168, 83),
}
LEGEND = {"free": "free", "owned": "owned (1 request)", "cached-idle": "cached, idle (evictable)",
          "cached-in-use": "cached, in use (1 request)", "shared": "shared (≥ 2 requests; darker = more)"}

WIDTH_PX = 600  # the map's fixed width; rows wrap
MAX_HEIGHT_PX = 300  # per worker, up to WIDTH_PX * MAX_HEIGHT_PX pages
MAX_PITCH = 10


def page_codes(states: list[str], ref_counts: list[int]) -> bytes:
    """One byte per page (see the module docstring)."""
    index = {s: i for i, s in enumerate(STATES)}
    codes = np.array([index.get(s, FREE) for s in states], dtype=np.int32)
    shared = codes == index["shared"]
    holders = np.asarray(ref_counts, dtype=np.int32) - 1  # the prefix index holds one reference
    codes[shared] = np.clip(2 + holders[shared], SHARED2, 255)
    return codes.astype(np.uint8).tobytes()


def counts_from_codes(codes: bytes) -> dict[str, int]:
    arr = np.frombuffer(codes, dtype=np.uint8)
    out = {s: int((arr == i).sum()) for i, s in enumerate(STATES[:4])}
    out["shared"] = int((arr >= SHARED2).sum())
    return out


def shade(code: int) -> tuple[int, int, int]:
    """RGB of one page code (the browser's canvas uses the same rule)."""
    if code < SHARED2:
        return COLOURS[STATES[code]]
    f = max(0.45, 1.0 - 0.12 * (code - SHARED2))  # two holders: the base colour
    r, g, b = COLOURS["shared"]
    return int(r * f), int(g * f), int(b * f)


def grid_layout(num_pages: int, width: int = WIDTH_PX, max_height: int = MAX_HEIGHT_PX) -> tuple[int, int, int]:
    """(pitch, columns, rows): square cells of `pitch` pixels (a 1-pixel gap from pitch 3 up)
    filling a fixed width, as large as fits in `max_height`."""
    n = max(1, num_pages)
    pitch = max(1, min(MAX_PITCH, int(math.sqrt(width * max_height / n))))
    while pitch > 1 and math.ceil(n / (width // pitch)) * pitch > max_height:
        pitch -= 1
    columns = width // pitch
    return pitch, columns, int(math.ceil(n / columns))


def grid_shape(num_pages: int, columns: int | None = None) -> tuple[int, int]:
    """(rows, columns) of the map."""
    if columns is None:
        _, columns, _ = grid_layout(num_pages)
    return int(math.ceil(max(1, num_pages) / columns)), columns


def render_codes_png(codes: bytes, *, pitch: int | None = None, columns: int | None = None) -> bytes:
    n = len(codes)
    if pitch is None or columns is None:
        pitch, columns, _ = grid_layout(n)
    rows = int(math.ceil(max(1, n) / columns))
    gap = 1 if pitch >= 3 else 0
    img = np.full((rows * pitch + gap, columns * pitch + gap, 3), 255, dtype=np.uint8)
    palette = np.array([shade(c) for c in range(256)], dtype=np.uint8)
    colours = palette[np.frombuffer(codes, dtype=np.uint8)]
    for i in range(n):
        r, c = divmod(i, columns)
        img[r * pitch + gap:(r + 1) * pitch, c * pitch + gap:(c + 1) * pitch] = colours[i]
    return encode_png(img)


def render_page_grid(states: list[str], ref_counts: list[int] | None = None, *, cell: int | None = None,
                     columns: int | None = None) -> bytes:
    """PNG bytes of the map: `cell`-pixel squares with a 1-pixel gap, row-major page order."""
    codes = page_codes(states, ref_counts if ref_counts is not None else [1] * len(states))
    return render_codes_png(codes, pitch=None if cell is None else cell + 1, columns=columns)


def encode_png(rgb: np.ndarray) -> bytes:
    """Minimal PNG encoder for an (h, w, 3) uint8 array."""
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))  # filter type 0 per scanline

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b"")


def png_data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()
