"""The stop-string matcher's cost with the API's largest stops: 16 x 60 KB over 512 tokens.

    .venv/bin/python benchmarks/stop_string_cost.py

Stop 0 is "abab..." and the generated text keeps matching its prefix, so that prefix stays
held; the 15 other stops never match. `QuadraticMatcher` is the matcher before issue 26
(every prefix length of every stop re-tested on every token), kept here only to compare.
The unit test (tests/unit/sampling/test_stop_strings.py) counts the new matcher's steps instead of timing.
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


def main():
    n = 60 * 1024
    stops = [("ab" * n)[:n]] + [chr(ord("c") + i) * n for i in range(15)]
    print("| token chars | matcher | 512 tokens (s) | per token (ms) |\n|---|---|---|---|")
    for chars in (4, 8, 16):
        for name, cls in (("before (quadratic)", QuadraticMatcher), ("after (KMP)", StopStringMatcher)):
            m = cls(stops)
            start = time.perf_counter()
            for _ in range(512):
                m.feed("ab" * (chars // 2))
            dt = time.perf_counter() - start
            print(f"| {chars} | {name} | {dt:.3f} | {dt / 512 * 1e3:.3f} |")


if __name__ == "__main__":
    main()
