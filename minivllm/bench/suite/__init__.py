"""`minivllm bench all`: every benchmark of the project, one after another.

The package: table.py (SUITE, the plan), plan.py (expanding it into commands), run.py (running them,
the index), cli.py (the `bench all` command). The benchmarks are the registry's drivers
(minivllm/bench/registry.py); a planned command is checked against its driver's own arguments.

SUITE below is the plan: one row per benchmark with its command, its arguments for
`--quick` (small models, few tokens, 1 run: a check that every driver still works and
writes its files) and for the full run (the sizes the published tables use), and how it
takes devices. Each benchmark runs as its own `python -m minivllm ...` subprocess, so a
crash or an out-of-memory in one does not stop the others and each starts a fresh
process and engine. Per benchmark the orchestrator records the command line, exit code,
wall time, the result files that appeared in benchmarks/results/ during it, and the tail
of its output when it failed; then it writes benchmarks/results/bench-all-<devices>-<stamp>.json
and .md and exits 1 if anything failed.

Arguments may hold placeholders, filled in per run:

* ``{dtypes}``: one ``--activation-dtype X`` per activation dtype that every device of the
  run supports (f32, f16; bf16 on CPUs and on GPUs of sm_80 or newer);
* ``{results}``, ``{tag}``, ``{stamp}``: the results directory, the run's device tag and
  the suite's time stamp (for drivers that take an output path, e.g. `smoke --json`);
* ``?--flag``: ``--flag`` only if the subcommand has that option (for drivers added later).

The devices are passed as ``--inference-device D`` (when the subcommand has that option),
according to the row's mode:

* NONE: no device (file format work);
* EACH: one run per device;
* ALL: one run with every device (each becomes a worker or a measured column);
* PAIR: one run with at least two workers: the devices given if there are two or more,
  else [cuda:N, cpu] for one GPU, else two one-thread CPU workers (the drivers' default);
* GPU: one run per CUDA device; skipped when none is given;
* CPU: one run on the first CPU device given; skipped when none is.

Test hook: $MINIVLLM_BENCH_ALL_EXTRA_ARGS, a JSON object name → list of extra arguments,
appends arguments to a benchmark's command (tests inject a bogus one to make it fail).
"""

from minivllm.bench.suite.plan import EXTRA_ARGS_ENV, Run, device_tag, is_cuda, plan, supported_dtypes
from minivllm.bench.suite.run import package_commit, run_suite, write_index
from minivllm.bench.suite.table import ALL, CPU, EACH, EXCLUDED, GPU, NONE, NOT_IMPLEMENTED, PAIR, SUITE, Bench, by_name

__all__ = [
    "ALL",
    "CPU",
    "EACH",
    "EXCLUDED",
    "EXTRA_ARGS_ENV",
    "GPU",
    "NONE",
    "NOT_IMPLEMENTED",
    "PAIR",
    "SUITE",
    "Bench",
    "Run",
    "by_name",
    "device_tag",
    "is_cuda",
    "package_commit",
    "plan",
    "run_suite",
    "supported_dtypes",
    "write_index",
]
