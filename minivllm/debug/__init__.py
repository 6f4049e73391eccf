"""Tools for finding out why two "identical" generations differ.

    from minivllm.debug import compare
    report = compare("smollm2-135m", prompt, a={"gemv_max_rows": 0}, b={"gemv_max_rows": 4096}, max_tokens=200)
    print(report.summary())

`compare` (compare.py) runs both sides greedily and finds the first differing token;
`divergence_report.py` holds the result; `hidden_state_diff.py` replays the common
prefix and diffs the residual streams layer by layer; `engine_options.py` checks and
parses the option names; `case_search.py` looks for prompts that split late.
"""

from minivllm.debug.compare import compare
from minivllm.debug.divergence_report import DivergenceReport

__all__ = ["compare", "DivergenceReport"]
