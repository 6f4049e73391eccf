"""The record every benchmark driver registers (see registry.py).

A driver declares its command-line arguments (`add_arguments`), a settings dataclass whose
fields are named as the parsed arguments' dests (`settings`), and `run(settings) -> exit code`.
`add_arguments` must stay cheap, no torch, because `minivllm --help` builds every parser;
`run` imports the heavy measuring module itself.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Driver:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    settings: type
    run: Callable[[Any], int]
    command: tuple[str, ...] = ()     # the words after `minivllm`; default ("bench", name)

    @property
    def argv(self) -> tuple[str, ...]:
        return self.command or ("bench", self.name)

    def settings_from(self, args: argparse.Namespace):
        return self.settings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(self.settings)})

    def main(self, args: argparse.Namespace) -> int:
        return int(self.run(self.settings_from(args)) or 0)

    def add_to(self, subparsers) -> argparse.ArgumentParser:
        """This driver's sub-command under `subparsers`, wired to `main`."""
        p = subparsers.add_parser(self.argv[-1], help=self.help)
        self.add_arguments(p)
        p.set_defaults(func=self.main)
        return p
