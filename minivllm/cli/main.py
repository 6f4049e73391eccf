"""The `minivllm` command line."""

from __future__ import annotations

import argparse
import sys

from minivllm.errors import MinivllmError


def build_parser() -> argparse.ArgumentParser:
    from minivllm.cli.bench_cmd import add_bench_parser
    from minivllm.cli.diverge_cmd import add_diverge_parser
    from minivllm.cli.generate_cmd import add_generate_parser
    from minivllm.cli.models_cmd import add_models_parser
    from minivllm.cli.serve_cmd import add_serve_parser
    from minivllm.cli.smoke_cmd import add_smoke_parser

    parser = argparse.ArgumentParser(prog="minivllm", description="A Jupyter-first LLM inference workbench.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_models_parser(sub)
    add_generate_parser(sub)
    add_bench_parser(sub)
    add_diverge_parser(sub)
    add_smoke_parser(sub)
    add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except MinivllmError as exc:
        # User errors get one clear line, not a traceback.
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
