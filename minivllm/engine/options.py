"""Engine options as users write them: the one parser for KEY=VALUE overrides.

`bench --option`, `minivllm diverge --a/--b`, `debug.compare`, the smoke run and the
divergence widget all read options through here, with one rule for values
(`parse_option_value`) and one check of names. The valid names are read off the
dataclasses the engine builds from them, so an option added to `EngineConfig` or
`KernelOptions` is accepted everywhere without an edit. Checking names up front matters
for a comparison: a typo on one side would otherwise surface only after the other side
had already generated.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, Field, fields

from minivllm.engine.engine_config import EngineConfig
from minivllm.errors import ConfigError


def option_fields() -> list[Field]:
    """Every engine option, in declaration order (kernel settings first)."""
    return list(fields(EngineConfig))


def options_by_group(exclude: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """Option names under their declared group headings, in declaration order."""
    groups: dict[str, list[str]] = {}
    for f in option_fields():
        if f.name not in exclude:
            groups.setdefault(f.metadata.get("group", "engine"), []).append(f.name)
    return groups


def options_summary(exclude: tuple[str, ...] = ()) -> str:
    """'kernels: gemv_max_rows, ...; kv cache: kv_mode, ...': every option, for docstrings."""
    return "; ".join(f"{group}: {', '.join(names)}" for group, names in options_by_group(exclude).items())


def engine_option_names() -> list[str]:
    return sorted(f.name for f in option_fields())


def option_default(name: str):
    """The engine's own default for option `name` (what runs when nobody sets it)."""
    f = next((f for f in option_fields() if f.name == name), None)
    if f is None:
        raise ConfigError("option", name, f"unknown engine option; valid ones: {', '.join(engine_option_names())}")
    return f.default if f.default is not MISSING else f.default_factory()


def add_engine_flags(
    parser: argparse.ArgumentParser, *, exclude: tuple[str, ...] = (), draft_model: bool = True
) -> None:
    """One `--kebab-name` flag per engine option, grouped under its `group` heading, help
    from its declaration. Booleans get `--x/--no-x`; other values are parsed like KEY=VALUE
    values (`parse_option_value`) and checked by EngineConfig itself, so every command
    accepts the same values and reports a bad one the same way. A flag left out is absent
    from the namespace (argparse.SUPPRESS), so the engine's default applies: the one
    default, whichever command starts it. `draft_model=True` adds `--draft-model` to the
    speculative group (a model, not an option, but what turns those options on)."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in option_fields():
        if f.name in exclude or not f.metadata.get("flag", True):
            continue
        group = f.metadata.get("group", "engine")
        if group not in groups:
            groups[group] = parser.add_argument_group(f"engine options: {group}")
        help_text = f"{f.metadata.get('help', '')} (default: {f.default})"
        flag = "--" + f.name.replace("_", "-")
        if f.default is False or f.default is True:
            groups[group].add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                       default=argparse.SUPPRESS, help=help_text)
        else:
            choices = f.metadata.get("choices")
            groups[group].add_argument(flag, dest=f.name, type=parse_option_value, default=argparse.SUPPRESS,
                                       metavar="{" + ",".join(map(str, choices)) + "}" if choices else None,
                                       help=help_text)
    if draft_model:
        speculative = groups.get("speculative") or parser.add_argument_group("engine options: speculative")
        speculative.add_argument("--draft-model", default=None, help="a smaller model with the same tokenizer that "
                                 "proposes tokens for the target to verify (turns speculative decoding on)")


def engine_options_from_args(args: argparse.Namespace) -> dict:
    """The engine options given on the command line (flags from `add_engine_flags`)."""
    return {f.name: getattr(args, f.name) for f in option_fields() if hasattr(args, f.name)}


def check_engine_options(options: dict, side: str) -> dict:
    """Return `options` as a plain dict, or raise naming the unknown key and the valid ones."""
    if not isinstance(options, dict):
        raise ConfigError(side, options, "expected a dict of engine options, e.g. {'gemv_max_rows': 0}")
    valid = engine_option_names()
    for key in options:
        if key not in valid:
            raise ConfigError(f"{side}.{key}", options[key], f"unknown engine option; valid ones: {', '.join(valid)}")
    return dict(options)


def parse_option_value(text: str):
    """'0' → 0, '0.5' → 0.5, 'true'/'false' → bool, 'none' → None, '"text"' → text (JSON
    quoting, as the widgets write values back), anything else stays a string."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] == '"':
        import json

        return json.loads(text)
    lowered = text.lower()
    if lowered in ("true", "yes", "on"):
        return True
    if lowered in ("false", "no", "off"):
        return False
    if lowered in ("none", "null"):
        return None
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def parse_overrides(items: list[str] | str, side: str = "option") -> dict:
    """['gemv_max_rows=0', 'dequant_cache=true'] (or one comma-separated string, or a JSON
    object as text) → {'gemv_max_rows': 0, 'dequant_cache': True}, names checked.
    `side` names the flag or field in errors ("option" → "--option")."""
    if isinstance(items, str):
        text = items.strip()
        if text.startswith("{"):
            import json

            try:
                return check_engine_options(json.loads(text), side)
            except ValueError as e:
                raise ConfigError(f"--{side}", text, f"not a JSON object: {e}") from None
        items = [part for part in text.split(",") if part.strip()]
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ConfigError(f"--{side}", item, "expected KEY=VALUE, e.g. gemv_max_rows=0")
        options[key] = parse_option_value(value.strip())
    return check_engine_options(options, side)
