"""Sampling: `SamplingParams`, the sampler, stop strings and the output records.

A leaf package: it imports nothing from minivllm but `errors`, so the engine and the
speculative decoder both build on it without importing each other.

How the package works (the design notes that ARCHITECTURE.md used to carry):

Sampling: validated `SamplingParams`; penalties, then temperature, top-k/top-p/min-p,
then a draw from the request's own seeded generator; top-n logprobs; stop strings that
span token boundaries (one lazily built KMP automaton per stop: work linear in the
generated text, independent of the stops' length). `TokenEvent`, `RequestOutput`,
`RequestMetrics`. A leaf package (it imports only `errors`), so the engine and spec both
use it without importing each other
"""
