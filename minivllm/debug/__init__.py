"""Tools for finding out why two "identical" generations differ.

    from minivllm.debug import compare
    report = compare("smollm2-135m", prompt, a={"gemv_max_rows": 0}, b={"gemv_max_rows": 4096}, max_tokens=200)
    print(report.summary())
    compare("smollm2-135m", prompt, a={}, b="transformers").first_layer_difference  # where the engine leaves it

`compare` (compare.py) runs both sides greedily and finds the first differing token;
`sides.py` says what a side may be (engine options, a device and dtype, or an outside
engine) and runs minivllm's; `reference_sides.py` runs transformers (float32, the same
GGUF file) and llama.cpp; `divergence_report.py` holds the result; `hidden_state_diff.py`
replays the common prefix and diffs the residual streams layer by layer;
`case_search.py` looks for prompts that split late.

How the package works (the design notes that ARCHITECTURE.md used to carry):

`compare(model, prompt, a={...}, b={...})`: greedy runs on two sides, top-k logits and
margins per position (through `logits_hook` for minivllm), the first split, and
per-layer residual-stream differences from a replay of the common prefix chunked as
each side's engine chunked it. Sides on the base LLM's device and dtype fork it (shared
weights); a side with another `device`/`dtype` loads the file again there; `"transformers"`
is the float32 reference (its `hidden_states` tuple lines up with the engine's record
once its last, final-normed entry is replaced by the last layer's pre-norm output, see
reference_sides.py); `"llama.cpp"` gives logits only. Between different computations the
layer table is made even without a split, and `first_layer_difference` says where b first
leaves a. `minivllm diverge` prints it; `data/divergence/` holds the reproduced
GEMM-vs-GEMV case.
"""

from minivllm.debug.compare import compare
from minivllm.debug.divergence_report import DivergenceReport, token_number

__all__ = ["compare", "DivergenceReport", "token_number"]
