"""Sampling: `SamplingParams`, the sampler, stop strings and the output records.

A leaf package: it imports nothing from minivllm but `errors`, so the engine and the
speculative decoder both build on it without importing each other.
"""
