"""Giving the heap a large request freed back to the operating system.

Issue 39 saw the controller's RSS grow from 287 MB to about 900 MB over repeated ~900 KB
prompts, then stay there. Measured here (SmolLM2, ten 900 KB prompts, each refused for
its length after being tokenized): RSS 341 -> 547 MB; `tracemalloc` found no Python
object left behind (the largest survivor was the client's own last body), and glibc's
`malloc_trim(0)` brought RSS back to 358 MB. So nothing of ours kept the prompts: glibc
keeps the freed memory of its per-thread arenas (the body, its parsed JSON, the
tokenizer's buffers and the 443k-id lists are made on the event loop's thread and on the
offload threads), ready for reuse but counted in RSS.

`http_guards.BodySizeLimit` calls `release_freed_memory` (off the event loop) once a
request whose body was at least `LARGE_BODY_BYTES` has ended, at most one trim at a time;
small requests, the usual ones, never pay for it. Where glibc is not the allocator, nothing happens.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

LARGE_BODY_BYTES = 256 * 1024

_trimming = threading.Lock()


def _load_malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows)
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


MALLOC_TRIM = _load_malloc_trim()


def release_freed_memory() -> bool:
    """Return free heap pages of every glibc arena to the OS; False if there is no
    `malloc_trim` here or another trim is under way."""
    if MALLOC_TRIM is None or not _trimming.acquire(blocking=False):
        return False
    try:
        MALLOC_TRIM(0)
        return True
    finally:
        _trimming.release()


def worth_releasing(body_bytes: int) -> bool:
    return MALLOC_TRIM is not None and body_bytes >= LARGE_BODY_BYTES
