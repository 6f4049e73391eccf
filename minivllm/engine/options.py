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

from dataclasses import fields

from minivllm.engine.engine_config import EngineConfig
from minivllm.errors import ConfigError
from minivllm.kernels.kernel_options import KernelOptions

# Engine switches that live on neither dataclass (CUDA graphs on/off).
_EXTRA_OPTIONS = ("enforce_eager",)
# Dataclass fields that are state, not settings.
_NOT_OPTIONS = {"path_counts"}


def engine_option_names() -> list[str]:
    names: list[str] = []
    for cls in (EngineConfig, KernelOptions):
        names += [f.name for f in fields(cls) if f.name not in _NOT_OPTIONS]
    names += _EXTRA_OPTIONS
    return sorted(set(names))


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
