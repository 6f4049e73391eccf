"""The stop-string matcher's work is linear in the generated text, whatever the stops' length.

Work is counted (`StopStringMatcher.steps`, every inner-loop iteration), not timed. The
issue's case: 16 stops of 60 KB (the API's limits) over 512 tokens whose text keeps
matching one stop's prefix, so its prefix stays held, while the 15 others never match.
The outputs are checked against a brute-force reference over the whole received text
on random cases with repetitive alphabets (the ones that exercise failure links).
"""

from __future__ import annotations

import random

from minivllm.sampling.stop_strings import StopStringMatcher

L = 60 * 1024


def run(stops: list[str], chunks: list[str]) -> tuple[str, bool, StopStringMatcher]:
    m = StopStringMatcher(stops)
    out, hit = "", False
    for chunk in chunks:
        text, hit = m.feed(chunk)
        out += text
        if hit:
            break
    return out, hit, m


def adversarial_stops(length: int) -> list[str]:
    return [("ab" * length)[:length]] + [chr(ord("c") + i) * length for i in range(15)]


def test_work_is_linear_in_text_and_independent_of_stop_length():
    tokens = ["abab"] * 512
    chars = sum(map(len, tokens))
    out, hit, m = run(adversarial_stops(L), tokens)
    assert not hit and out == "" and m.pending == "".join(tokens)  # all held: it may still become stop 0
    assert m.steps <= 3 * chars * 16, m.steps  # a few steps per character per stop
    # Twice the stop length: the same work. Twice the text: twice the work.
    assert run(adversarial_stops(2 * L), tokens)[2].steps == m.steps
    assert run(adversarial_stops(L), tokens * 2)[2].steps <= 2 * m.steps + 16
    print(f"16 x {L} B stops, 512 tokens ({chars} chars): {m.steps} steps")


def test_long_stop_released_and_hit():
    stop = "ab" * 1000 + "c"
    out, hit, m = run([stop, "zz"], ["ab"] * 1000 + ["x", "ab" * 1000, "c", "tail"])
    assert hit and out == "ab" * 1000 + "x"
    assert m.steps <= 3 * (2 * 4001 + 1) * 2


def reference(stops: list[str], chunks: list[str]) -> tuple[list[str], bool]:
    """After each chunk: the text before the earliest occurrence of any stop (and stop), or
    everything but the longest suffix that is a proper prefix of some stop."""
    received, released = "", []
    for chunk in chunks:
        received += chunk
        hits = [received.find(s) for s in stops if s in received]
        if hits:
            released.append(received[: min(hits)])
            return released, True
        hold = max((n for s in stops for n in range(1, len(s)) if received.endswith(s[:n])), default=0)
        released.append(received[: len(received) - hold])
    return released, False


def test_random_cases_match_the_brute_force_reference():
    rng = random.Random(26)
    for case in range(3000):
        alphabet = rng.choice(["ab", "aab", "ab<|>", "abc"])
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 9))) for _ in range(rng.randint(1, 4))]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        chunks, i = [], 0
        while i < len(text):
            n = rng.randint(1, 6)
            chunks.append(text[i:i + n])
            i += n
        want, want_hit = reference(stops, chunks)
        m = StopStringMatcher(stops)
        emitted = ""
        for k, chunk in enumerate(chunks):
            out, hit = m.feed(chunk)
            emitted += out
            assert emitted == want[k], (case, stops, chunks, k)
            if hit:
                break
        assert hit == want_hit if chunks else True
        if not want_hit:
            assert emitted + m.flush() == text
