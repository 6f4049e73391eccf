"""The KV page map as a PNG: one cell per page, coloured by state, sent as binary bytes.

A pool has thousands of pages; a JSON list per update would be tens of kilobytes of text
per worker at 20 Hz. An `ipywidgets.Image` carries the PNG as a binary buffer in one
message, and the same bytes serve the static fallback (`<img src="data:...">`). The PNG
is written with zlib alone (no imaging library needed).
"""

from __future__ import annotations

import base64
import math
import struct
import zlib

import numpy as np

# state -> RGB. Shared pages get darker with more holders (ref counts), so prefix reuse
# and single-flight show as deepening colour.
COLOURS = {
    "free": (235, 237, 240),
    "owned": (66, 133, 244),
    "cached-idle": (251, 188, 5),
    "shared": (52, 168, 83),
}
LEGEND = {"free": "free", "owned": "owned by one request", "cached-idle": "cached, idle (evictable)",
          "shared": "shared (darker = more holders)"}


def page_colours(states: list[str], ref_counts: list[int] | None = None) -> np.ndarray:
    """(pages, 3) uint8 colours."""
    out = np.empty((len(states), 3), dtype=np.uint8)
    for i, state in enumerate(states):
        r, g, b = COLOURS.get(state, (0, 0, 0))
        if state == "shared" and ref_counts is not None:
            shade = max(0.45, 1.0 - 0.12 * max(0, ref_counts[i] - 2))
            r, g, b = int(r * shade), int(g * shade), int(b * shade)
        out[i] = (r, g, b)
    return out


def grid_shape(num_pages: int, columns: int | None = None) -> tuple[int, int]:
    columns = columns or max(8, min(64, int(math.ceil(math.sqrt(num_pages * 2)))))
    return int(math.ceil(num_pages / columns)), columns


def render_page_grid(states: list[str], ref_counts: list[int] | None = None, *, cell: int = 6,
                     columns: int | None = None) -> bytes:
    """PNG bytes: a grid of `cell`-pixel squares with a 1-pixel gap, row-major page order."""
    rows, cols = grid_shape(max(1, len(states)), columns)
    colours = page_colours(states, ref_counts)
    pitch = cell + 1
    img = np.full((rows * pitch + 1, cols * pitch + 1, 3), 255, dtype=np.uint8)
    for i, colour in enumerate(colours):
        r, c = divmod(i, cols)
        img[r * pitch + 1:(r + 1) * pitch, c * pitch + 1:(c + 1) * pitch] = colour
    return encode_png(img)


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
