"""How an engine option is declared: a dataclass field that carries its help and group.

`EngineConfig` and `KernelSettings` declare every option with `option(...)`; the CLI
flags (`engine/options.py: add_engine_flags`), the KEY=VALUE parser, the widgets'
defaults and the docs all read these fields, so an option is written down once. This
module is a leaf (it imports only errors.py) because both the kernel and the engine layers use it.
"""

from __future__ import annotations

from dataclasses import field, fields

from minivllm.errors import ConfigError


def option(default, help: str, group: str, *, choices: tuple | None = None, flag: bool = True):
    """A dataclass field for an engine option. `help` is the flag's help text, `group`
    the heading it is listed under, `choices` the allowed values where they are a fixed
    set (checked by the dataclass itself; shown in --help), `flag=False` keeps it off the
    command line (still settable as KEY=VALUE and from Python)."""
    return field(default=default, metadata={"help": help, "group": group, "choices": choices, "flag": flag})


def check_choices(settings) -> None:
    """Raise ConfigError naming the first option of the dataclass `settings` whose value is
    not one of its declared `choices`."""
    for f in fields(settings):
        choices = f.metadata.get("choices")
        if choices is not None and getattr(settings, f.name) not in choices:
            raise ConfigError(f.name, getattr(settings, f.name), f"allowed: {', '.join(map(str, choices))}")
