"""Reliability tools: long, randomised traffic against a real server, then checks that nothing
was lost or leaked (soak.py). Not benchmarks: they measure invariants, not speed."""
