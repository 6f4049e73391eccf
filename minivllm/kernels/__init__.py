"""Numerical building blocks: norms, RoPE, attention, linear layers.

Everything here is the plain-torch reference; later fast paths (Triton on CUDA,
packed-int CPU matmuls) are tested against these functions.
"""
