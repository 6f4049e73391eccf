"""Requests, the scheduler, the step loop and the `LLM` front end.

How the package works (the design notes that ARCHITECTURE.md used to carry):

`Request` holds one request's state (`all_ids`, `num_computed`, block table);
`RequestView` is its read-only face. `Scheduler` does continuous batching: decode rows
first, then prefill chunks under a per-step token budget, with the `fcfs`,
`shortest-prefill-first` and `round-robin` policies, page-reserving admission through
the `KVManager` (which first restores the longest cached prefix of `all_ids[:-1]` and
reserves pages only for the rest; single-flight followers are not admitted until
released), and preemption of the newest request when pages run out (a preempted request
later restores its own published pages). `Scheduler.update` applies each step's
`RunnerOutput` (`runner_output.py`): it is the one place requests advance (tokens
appended through `token_append.py`, rounds verified by the runner applied, requests
finished) and the only caller of the `KVManager` mutators, the draft pool's included. It
publishes a request's full computed pages after every successful forward
(`publication="incremental"`) or when it finishes or is aborted (`"at_completion"`; a
failed request publishes nothing more); with single-flight it keeps the leader's prompt
logits, and released followers take their first token from them (own settings and
generator, drawn by the runner) before being admitted. `ModelRunner`
(`model_runner.py`) is the only code that runs a model: the draft's forwards
(`draft_runner.py`), the step's inputs in persistent buffers (`step_inputs.py`), the
target forward (graph or eager), masks, draws and verification; it changes no request
and calls no `KVManager`. `LLMEngine` runs `step()` (schedule → `runner.execute` →
`scheduler.update`) and `run()`, the one step loop (`LLM`, the serving worker and
`debug.compare` drive it; a host applies submissions and aborts in its `between_steps`
hook, and the worker's last net is its `on_error`), and provides `add_request`,
`abort`, `release`, `snapshot()` (schema in `snapshot.py`), `logits_hook`,
`reset_stats` and read-only views (`request_state`, `request_ids`, `progress`,
`cached_prefix_tokens`, `kv_ownership`); its request table, scheduler and KV manager
are private. Kernel options are per engine and per call: the runner passes its own to
every forward (a context variable, `kernels/kernel_options.py`), so engines over one
model never share them. `cuda_graphs.py`: decode-only steps replay one CUDA graph per
batch bucket (static buffers, padding rows in one reserved scratch page, lazy capture
after an eager warm-up; a failed capture falls back to eager and is reported);
`enforce_eager` turns it off; `decode_graph_runner` decides whether graphs can run here,
for the target and the draft. `request_checks.py` is the one home of the request checks
(`LLM`, the engine and `Cluster` use it). `LLM.fork(**options)` makes a second
engine over the same weights. `LLM` is the vLLM-shaped sync API over `LLMEngine`
"""
