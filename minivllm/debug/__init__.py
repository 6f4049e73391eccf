"""Tools for finding out why two "identical" generations differ.

    from minivllm.debug import compare
    report = compare("smollm2-135m", prompt, a={"gemv_max_rows": 0}, b={"gemv_max_rows": 4096}, max_tokens=200)
    print(report.summary())

`compare` (compare.py) runs both sides greedily and finds the first differing token;
`divergence_report.py` holds the result; `hidden_state_diff.py` replays the common
prefix and diffs the residual streams layer by layer; `engine_options.py` checks and
parses the option names; `case_search.py` looks for prompts that split late.

How the package works (the design notes that ARCHITECTURE.md used to carry):

`compare(model, prompt, a={...}, b={...})`: greedy runs under two engine-option sets
over one loaded model, top-k logits and margins per position through `logits_hook`, the
first split, and per-layer residual-stream differences from a replay of the common
prefix chunked as each side's engine chunked it. `minivllm diverge` prints it;
`data/divergence/` holds the reproduced GEMM-vs-GEMV case
"""

from minivllm.debug.compare import compare
from minivllm.debug.divergence_report import DivergenceReport

__all__ = ["compare", "DivergenceReport"]
