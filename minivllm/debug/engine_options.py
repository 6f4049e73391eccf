"""Engine options as a user writes them for `compare` and `minivllm diverge`: names and values.

The valid names are read off the dataclasses the engine builds from them, so an
option added to `EngineConfig` or `KernelOptions` is accepted here without an edit.
Checking names up front matters for a comparison: a typo on one side would otherwise
surface only after the other side had already generated.
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
    """'0' → 0, '0.5' → 0.5, 'true'/'false' → bool, 'none' → None, anything else stays a string."""
    lowered = text.strip().lower()
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


def parse_assignments(items: list[str], side: str) -> dict:
    """['gemv_max_rows=0', 'dequant_cache=true'] → {'gemv_max_rows': 0, 'dequant_cache': True}."""
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ConfigError(f"--{side}", item, "expected KEY=VALUE, e.g. gemv_max_rows=0")
        options[key] = parse_option_value(value)
    return check_engine_options(options, side)
