"""GGUF file access: reading, type tables and dequantization."""
