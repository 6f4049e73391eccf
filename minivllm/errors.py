"""One error hierarchy for everything a user can get wrong.

Every message names the offending thing and says what to do about it. Catch
`MinivllmError` to handle all of them; the subclasses exist so callers (the CLI,
later the HTTP server) can map them to exit codes or status codes.
"""

from __future__ import annotations


class MinivllmError(Exception):
    """Base class of every error minivllm raises on purpose."""


# How much of a client's input an error may quote: a message that names a 500 KB grammar
# or a 100k-entry choice list must not send it back (issue 39). `quoted` bounds one value,
# `bounded_message` a whole message (every HTTP error body goes through it).
QUOTE_LIMIT = 200
MESSAGE_LIMIT = 600


def quoted(value: object) -> str:
    """`repr(value)`, cut to QUOTE_LIMIT characters with a note of its full length."""
    text = repr(value)
    if len(text) <= QUOTE_LIMIT:
        return text
    return f"{text[:QUOTE_LIMIT]}... ({len(text)} characters in all)"


def bounded_message(message: str) -> str:
    """`message`, cut in the middle to MESSAGE_LIMIT characters: its start names the
    thing and its end usually says the fix, whatever input sits between."""
    if len(message) <= MESSAGE_LIMIT:
        return message
    head, tail = MESSAGE_LIMIT * 2 // 3, MESSAGE_LIMIT // 3
    return f"{message[:head]} ... [{len(message) - head - tail} characters cut] ... {message[-tail:]}"


# --- model sources -------------------------------------------------------------------


class ModelSourceError(MinivllmError):
    """A model could not be found, fetched or verified."""


class UnknownModelError(ModelSourceError):
    def __init__(self, name: str, known: list[str]):
        self.name = name
        self.known = known
        super().__init__(
            f"unknown model {name!r}: not a registered name and not an existing .gguf file. "
            f"Known names: {', '.join(known)}. Run `minivllm models list` to see them, "
            f"or pass a path to a .gguf file."
        )


class ModelNotCachedError(ModelSourceError):
    """The model is not in the local cache and we may not (or cannot) download it."""


class HashMismatchError(ModelSourceError):
    """An assembled or downloaded file does not have the published SHA-256."""


# --- GGUF files ----------------------------------------------------------------------


class GGUFFormatError(MinivllmError):
    """The file is not a GGUF file we can read (bad magic, truncated, unknown version)."""


class UnsupportedArchitectureError(MinivllmError):
    def __init__(self, arch: str, supported: list[str]):
        self.arch = arch
        super().__init__(
            f"model architecture {arch!r} is not supported; supported architectures: "
            f"{', '.join(supported)}. Use a GGUF file converted from one of those."
        )


class MissingTensorError(MinivllmError):
    def __init__(self, tensor: str, path: str):
        self.tensor = tensor
        super().__init__(
            f"tensor {tensor!r} is missing from {path}; the file is incomplete or was "
            f"converted for a different architecture. Re-convert or re-download it."
        )


class UnsupportedTensorTypeError(MinivllmError):
    def __init__(self, tensor: str, type_name: str, supported: list[str]):
        self.tensor = tensor
        self.type_name = type_name
        super().__init__(
            f"tensor {tensor!r} has type {type_name}, which minivllm cannot dequantize; "
            f"supported types: {', '.join(supported)}. Re-quantize the model to one of them."
        )


class MissingMetadataError(MinivllmError):
    def __init__(self, key: str, path: str):
        self.key = key
        super().__init__(
            f"metadata key {key!r} is missing from {path}; the file was written by a "
            f"converter minivllm does not understand. Re-convert it with a recent llama.cpp."
        )


class InvalidMetadataError(GGUFFormatError):
    """A metadata value has the wrong type or an impossible value (`general.alignment`
    = 3, `llama.block_count` stored as a string)."""

    def __init__(self, key: str, path: str, problem: str):
        self.key = key
        super().__init__(
            f"metadata key {key!r} in {path} {problem}; the file is corrupt or was written by a "
            f"converter minivllm does not understand. Re-download it, or re-convert it with a recent llama.cpp."
        )


# --- tokenizer -----------------------------------------------------------------------


class TokenizerError(MinivllmError):
    """The GGUF vocabulary cannot be turned into a tokenizer, or a template failed."""


# --- configuration and devices -------------------------------------------------------


class ConfigError(MinivllmError, ValueError):
    """A configuration or request field has an invalid value."""

    def __init__(self, field: str, value: object, allowed: str):
        self.field = field
        self.value = value
        super().__init__(f"invalid {field}={quoted(value)}: {allowed}")


class DeviceError(MinivllmError):
    """A requested device does not exist or cannot do what was asked."""


class EngineNotInstalledError(ConfigError):
    """A comparison side names an outside engine (transformers, llama.cpp) whose Python
    package cannot be imported here. A ConfigError, so callers that catch bad settings
    catch this too; tests skip on it by name."""
