"""Model sources: registered names -> verified local GGUF files."""

from .registry import DEFAULT_MODEL, ModelEntry, ModelStatus
from .resolve import cached_model_path, list_models, pull_model, resolve_model

__all__ = [
    "DEFAULT_MODEL",
    "ModelEntry",
    "ModelStatus",
    "cached_model_path",
    "list_models",
    "pull_model",
    "resolve_model",
]
