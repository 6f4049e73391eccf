"""Reliability tools: long, randomised traffic against a real server, then checks that nothing
was lost or leaked (soak.py). Not benchmarks: they measure invariants, not speed.

How the package works (the design notes that ARCHITECTURE.md used to carry):

the soak (`minivllm bench soak`, registered like a driver): thousands of mixed, bursty,
partly cancelled requests against a real `minivllm serve`, then checks of the request
ledger, idle engines, free KV pages and RSS; a reliability tool, so not under `bench/`
"""
