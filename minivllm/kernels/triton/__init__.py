"""Triton GPU kernels (run on CPU tensors only under TRITON_INTERPRET=1, for tests)."""
