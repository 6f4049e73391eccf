"""Benchmark drivers. Each writes JSON + Markdown with provenance to benchmarks/results/."""
