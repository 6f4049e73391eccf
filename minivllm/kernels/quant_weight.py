"""A weight matrix kept in its GGUF block format on the device.

`raw` holds the file's bytes for an (N, K) matrix, one row of blocks per output
feature: shape (N, row_bytes), uint8. Kernels read it directly (the fused
dequantize-GEMV kernels), or `dequantize()` expands it for a GEMM. Keeping the blocks
is what makes a model's device memory about its file size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType

from minivllm.errors import UnsupportedTensorTypeError
from minivllm.gguf.dequant import dequantize
from minivllm.gguf.quant_types import SUPPORTED_NAMES, SUPPORTED_TYPES, row_nbytes, type_name

FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


@dataclass
class QuantizedWeight:
    raw: torch.Tensor  # (N, row_bytes) uint8 on the model's device
    ggml_type: GGMLQuantizationType
    shape: tuple[int, int]  # (N, K): out_features, in_features
    name: str = "weight"

    def __post_init__(self) -> None:
        try:
            self.ggml_type = GGMLQuantizationType(int(self.ggml_type))
        except ValueError:
            raise UnsupportedTensorTypeError(self.name, type_name(self.ggml_type), SUPPORTED_NAMES) from None
        if self.ggml_type not in SUPPORTED_TYPES:
            raise UnsupportedTensorTypeError(self.name, type_name(self.ggml_type), SUPPORTED_NAMES)
        n, k = self.shape
        expected = (n, row_nbytes(self.ggml_type, k))
        if self.raw.dtype != torch.uint8 or tuple(self.raw.shape) != expected:
            self.raw = self.raw.reshape(expected)

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)

    @property
    def is_float(self) -> bool:
        return self.ggml_type in FLOAT_TYPES

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    @property
    def device(self) -> torch.device:
        return self.raw.device

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The (N, K) matrix in `dtype`, bit-exact with gguf.quants' float32 values."""
        return dequantize(self.raw.reshape(-1), self.ggml_type, self.shape, dtype=dtype, tensor_name=self.name)
