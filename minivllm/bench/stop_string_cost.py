"""The stop-string matcher's cost with the API's largest stops: 16 x 60 KB over 512 tokens.

    minivllm bench stop-strings [--tokens 512]

Stop 0 is "abab..." and the generated text keeps matching its prefix, so that prefix stays
held; the 15 other stops never match. `QuadraticMatcher` is the matcher before the KMP one
(every prefix length of every stop re-tested on every token), kept here only to compare.
The unit test (tests/unit/sampling/test_stop_strings.py) counts the new matcher's steps instead of
timing. Results (JSON + Markdown with provenance) go to benchmarks/results/stop-string-cost-*.
"""

from __future__ import annotations

import time

from minivllm.sampling.stop_strings import StopStringMatcher


class QuadraticMatcher:
    def __init__(self, stops):
        self.stops, self.pending = stops, ""

    def feed(self, text):
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False


def run(tokens: int = 512, stop_count: int = 16, stop_chars: int = 60 * 1024, runs: int = 3) -> tuple:
    """Time both matchers over `tokens` tokens of 4, 8 and 16 characters; write the result files."""
    import statistics

    from minivllm.bench.common import provenance
    from minivllm.bench.results import write_results

    stops = [("ab" * stop_chars)[:stop_chars]] + [chr(ord("c") + i) * stop_chars for i in range(stop_count - 1)]
    rows = []
    for chars in (4, 8, 16):
        for name, cls in (("before (quadratic)", QuadraticMatcher), ("after (KMP)", StopStringMatcher)):
            times = []
            for _ in range(runs):
                m = cls(stops)
                start = time.perf_counter()
                for _ in range(tokens):
                    m.feed("ab" * (chars // 2))
                times.append(time.perf_counter() - start)
            row = {"token_chars": chars, "matcher": name, "median_s": statistics.median(times),
                   "mean_s": statistics.fmean(times), "std_s": statistics.stdev(times) if runs > 1 else 0.0,
                   "per_token_ms": statistics.median(times) / tokens * 1e3}
            print(row, flush=True)
            rows.append(row)
    for chars in (4, 8, 16):
        before, after = (r["median_s"] for r in rows if r["token_chars"] == chars)
        rows.append({"token_chars": chars, "matcher": "speed-up (median before / after)", "median_s": before / after})
    settings = {"tokens": tokens, "stops": stop_count, "stop_chars": stop_chars, "runs": runs}
    paths = write_results("stop-string-cost", provenance("cpu", None, settings), rows,
                          ["token_chars", "matcher", "median_s", "mean_s", "std_s", "per_token_ms"],
                          notes=__doc__.split("\n\n")[1])
    print(*paths)
    return paths
