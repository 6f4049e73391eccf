"""A worker's constrained submissions wait for their matcher off the step loop
(matcher_builds.py): held while the build runs, released in order once built, and an
abort that comes meanwhile is kept for when the request is in."""

from __future__ import annotations

import threading
from dataclasses import asdict

from minivllm.sampling.sampling_params import SamplingParams
from minivllm.serving.matcher_builds import MatcherBuilds


class SlowConstraints:
    def __init__(self):
        self.release = threading.Event()
        self.prepared = []

    def prepare(self, structured):
        self.release.wait(10)
        self.prepared.append(structured)


def submission(rid: str, structured=None) -> dict:
    return {"op": "submit", "request_id": rid, "prompt_ids": [1],
            "params": asdict(SamplingParams(max_tokens=2, structured=structured))}


def test_constrained_submissions_wait_for_their_build_and_keep_their_abort():
    constraints = SlowConstraints()
    builds = MatcherBuilds(constraints)
    plain = builds.start(submission("plain"))
    first = builds.start(submission("a", {"regex": "[0-9]+"}))
    second = builds.start(submission("b", {"choice": ["x", "y"]}))
    assert not builds.hold(plain) and isinstance(plain["parsed_params"], SamplingParams)
    assert builds.hold(first) and builds.hold(second)
    assert builds.abort("b") and not builds.abort("plain")
    assert builds.done() == []  # still building
    constraints.release.set()
    first["matcher_ready"].result(10)
    second["matcher_ready"].result(10)
    released = builds.done()
    assert [m["request_id"] for m in released] == ["a", "b"]
    assert [m.get("aborted", False) for m in released] == [False, True]
    assert constraints.prepared == [first["parsed_params"].structured, second["parsed_params"].structured]
    builds.close()


def test_a_submission_whose_params_do_not_parse_is_left_for_the_step_loop():
    builds = MatcherBuilds(SlowConstraints())
    bad = {"op": "submit", "request_id": "r", "prompt_ids": [1], "params": {"temperature": -1}}
    assert builds.start(bad) is bad and not builds.hold(bad)
    builds.close()
