"""The ggml tensor types minivllm can turn into torch tensors, and their block sizes.

Every ggml type stores a row as back-to-back *blocks*: `block_size` elements packed
into `type_size` bytes. Plain float types are blocks of one element. The numbers come
from `gguf.GGML_QUANT_SIZES`, so they always agree with the installed `gguf` package.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from minivllm.errors import GGUFFormatError


@dataclass(frozen=True)
class QuantType:
    ggml_type: GGMLQuantizationType
    block_size: int  # elements per block
    type_size: int  # bytes per block

    @property
    def name(self) -> str:
        return self.ggml_type.name


def _entry(t: GGMLQuantizationType) -> QuantType:
    block_size, type_size = GGML_QUANT_SIZES[t]
    return QuantType(t, block_size, type_size)


_T = GGMLQuantizationType

#: Types `minivllm.gguf.dequant.dequantize` understands, keyed by enum member.
SUPPORTED_TYPES: dict[GGMLQuantizationType, QuantType] = {
    t: _entry(t)
    for t in (
        _T.F32, _T.F16, _T.BF16,
        _T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0,
        _T.Q2_K, _T.Q3_K, _T.Q4_K, _T.Q5_K, _T.Q6_K,
    )
}  # fmt: skip

SUPPORTED_NAMES: list[str] = [t.name for t in SUPPORTED_TYPES]


def type_name(ggml_type: GGMLQuantizationType | int) -> str:
    """The enum name of a ggml type id, or `type<N>` for ids `gguf` does not know."""
    try:
        return GGMLQuantizationType(int(ggml_type)).name
    except ValueError:
        return f"type{int(ggml_type)}"


def row_nbytes(ggml_type: GGMLQuantizationType | int, n_elements: int) -> int:
    """Bytes that `n_elements` consecutive values of `ggml_type` occupy.

    `n_elements` must be a whole number of blocks (a GGUF row always is). Raises
    `KeyError` for a type outside `SUPPORTED_TYPES` and `GGUFFormatError` for a
    partial block.
    """
    try:
        qt = SUPPORTED_TYPES[GGMLQuantizationType(int(ggml_type))]
    except ValueError:  # an id the gguf enum itself does not know
        raise KeyError(ggml_type) from None
    if n_elements % qt.block_size:
        raise GGUFFormatError(
            f"{n_elements} elements is not a whole number of {qt.name} blocks "
            f"({qt.block_size} elements each)"
        )
    return n_elements // qt.block_size * qt.type_size
