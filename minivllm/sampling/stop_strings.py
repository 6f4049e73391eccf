"""Stop strings that may straddle token boundaries.

Text is released to the client only once it can no longer turn out to be the start of
a stop string, so a client never sees half of a stop sequence it asked to suppress.

Each stop string is followed by a Knuth-Morris-Pratt automaton whose state is the
longest prefix of that stop the text received so far ends with; the text held back is
the longest such prefix over all stops. Every received character costs O(1) amortised
per stop, and the failure table is built lazily, only as far as a state has reached, so
the work for a request is linear in the text it generated times the number of stops,
however long the stops are (16 stops of 60 KB cost nothing until text matches them).
The previous matcher re-tested every prefix length of every stop on every token,
O(held text^2) per stop per token. `steps` counts the inner-loop iterations, for tests.
"""

from __future__ import annotations

from collections import deque


class _StopAutomaton:
    __slots__ = ("stop", "fail", "state")

    def __init__(self, stop: str):
        self.stop = stop
        self.fail = [0]  # fail[i]: longest proper border of stop[:i + 1], built up to the state reached
        self.state = 0


class StopStringMatcher:
    def __init__(self, stops: list[str]):
        self.stops = stops
        self._automata = [_StopAutomaton(s) for s in stops if s]
        self._held: deque[str] = deque()  # received characters not yet released
        self.steps = 0

    @property
    def pending(self) -> str:
        return "".join(self._held)

    def feed(self, text: str) -> tuple[str, bool]:
        """Add decoded text; return (text safe to emit, whether a stop string was hit)."""
        if not self._automata:
            out = "".join(self._held) + text
            self._held.clear()
            return out, False
        held = self._held
        first_start = None  # where the earliest-starting stop completed in this text begins, in `held`
        for ch in text:
            held.append(ch)
            end = len(held)
            for a in self._automata:
                if self._advance(a, ch):
                    start = end - len(a.stop)
                    if first_start is None or start < first_start:
                        first_start = start
                    a.state = 0  # its first occurrence is what counts
        if first_start is not None:
            out = "".join(held.popleft() for _ in range(first_start))
            held.clear()
            for a in self._automata:
                a.state = 0
            return out, True
        hold = max(a.state for a in self._automata)
        out = "".join(held.popleft() for _ in range(len(held) - hold))
        return out, False

    def _advance(self, a: _StopAutomaton, ch: str) -> bool:
        """One character through one stop's automaton; True when the stop completes."""
        stop, fail, q = a.stop, a.fail, a.state
        while q and stop[q] != ch:
            q = fail[q - 1]
            self.steps += 1
        if stop[q] == ch:
            q += 1
        self.steps += 1
        if q == len(stop):
            return True
        if q > len(fail):  # the state reached a prefix whose failure link is not built yet
            self._extend(a, q)
        a.state = q
        return False

    def _extend(self, a: _StopAutomaton, upto: int) -> None:
        stop, fail = a.stop, a.fail
        k = fail[-1]
        for i in range(len(fail), upto):
            while k and stop[i] != stop[k]:
                k = fail[k - 1]
                self.steps += 1
            if stop[i] == stop[k]:
                k += 1
            fail.append(k)
            self.steps += 1

    def flush(self) -> str:
        out = "".join(self._held)
        self._held.clear()
        for a in self._automata:
            a.state = 0
        return out
