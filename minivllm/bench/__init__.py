"""Benchmark drivers. Each writes JSON + Markdown with provenance to benchmarks/results/.

How the package works (the design notes that ARCHITECTURE.md used to carry):

benchmark drivers as a registry. `registry.DRIVERS` lists one `Driver` per command
(`driver.py`: name, help, `add_arguments(parser)`, a settings dataclass built from the
parsed arguments, `run(settings) -> exit code`); each lives in `drivers/<name>.py`,
cheap to import (the measuring module, with torch, is imported by `run`).
`cli/bench_cmd.py` adds one sub-command per driver; `bench all` (`suite/`: `table.py` is
the plan, one row per benchmark with quick/full arguments and a device mode; `plan.py`
checks every planned command against its driver's own parser; `run.py` runs each in its
own `python -m minivllm` process and writes `bench-all-<devices>-<stamp>.json/.md`)
reads the same registry and imports nothing from `cli`. `common.py` is the one home of
what drivers share: provenance (commit, device, versions, model hash, settings: every
result file carries it), the CV rule (`runs_until_stable`: at least N runs, more while a
CV exceeds 5%, up to a maximum), summary statistics, the load average and the common
flags, one spelling each (`--model`, `--inference-device`, `--activation-dtype`,
`--runs`/`--max-runs`, `--prompt-tokens`, `--max-tokens`, `--option KEY=VALUE` through
`engine.options.parse_overrides`, `--out`); `results.py` writes the result files.
`serve_load/` is the HTTP load generator (TTFT/TPOT/ITL/E2E, goodput; any
OpenAI-compatible URL, or a `minivllm serve` it starts through `server_process.py`);
`plots/` (`bench plot`, the last row of `bench all`) draws the newest result file of
each benchmark into `benchmarks/plots/*.png`. **Adding a benchmark driver**: write
`drivers/<name>.py` (`Settings`, `add_arguments` from `common.add_*`, `run`, `DRIVER =
Driver(...)`), add it to `registry.DRIVERS`, give it a row in `suite/table.py`
(tests/integration/bench/test_bench_all.py fails until it has one)
"""
