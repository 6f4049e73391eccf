"""Speculative decoding: a draft model proposes, the target verifies in one forward.

How the package works (the design notes that ARCHITECTURE.md used to carry):

speculative decoding, owned by `LLMEngine` when it is given a draft model (the engine
imports it; it imports the cache, model and sampling layers, never the engine; it keeps
no forward code: the engine's model runner runs the draft). `draft_compat` refuses a draft whose tokenizer differs
from the target's (first differing id named; padding rows of the embedding are ignored
by comparing over the tokenizer's ids). The scheduler's decode rows grow to 1 + k tokens
for requests that want to speculate, within the step budget and the pages free now
(never preempting). `Drafter` holds the draft's own `PagePool` and the `KVManager` that
keeps per-request draft block tables (driven by the engine's scheduler alone): the
runner's draft forwards (engine/draft_runner.py) do each request's catch-up and first
proposal, then one batched forward per further position (CUDA graphs on a GPU); a
request whose draft pages do not fit decodes plainly. The target's single forward scores
all k + 1 positions; `Speculator.verify` (called by the runner) walks each proposal (`verify.py`: greedy
equality, or min(1, π/q) acceptance with the max(p − q, 0) residual, π = p when
lossless, the TV-budget mixture when mentored), yielding accepted tokens and then a
replacement or a bonus token; the scheduler appends them, keeps target K/V for the
accepted positions (`KVManager.truncate` frees pages past the known tokens) and
truncates the draft's.
`draft_policy` gives each request a controller (fixed, acceptance-rate,
accepted-length), optionally behind the pay-off gate, which compares the request's
measured tokens/s with and without the draft and pauses speculation with a growing
back-off. Counters per request (`metrics.speculation`) and totals plus the latest rounds
in the snapshot's `speculative` section. `perturbed_draft.perturbed_copy(path, noise=)`
loads a model again with its final norm gain perturbed per channel: a same-tokenizer
draft that disagrees with its target some of the time (the speculative notebook's quick
mode, tests)
"""
