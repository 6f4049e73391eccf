"""A cluster's start with calibration in turns: every worker loads and warms up at once,
then the workers calibrate one after another, each alone.

Why: calibration times a worker's own engine steps (calibration.py), and a worker that
calibrates while a neighbour on the same host compiles its Triton kernels, captures its
CUDA graphs or calibrates too measures the neighbour's load, not its own speed. On the
H100 machine (h100-s51) the CPU worker, calibrated beside the GPU worker's start-up, came
out at 29.8 tokens/s at batch 1 and 34.7 in all at batch 4, where the same engine alone on
the same cores ran two rows in 1.38 times one row's step. Load from neighbours while
serving is the online corrections' business (worker_rates.py), not calibration's.

The worker's side (worker.py): with `calibrate_on_cue` in its config it reports the stage
`TURN_STAGE` after its warm-up and waits for a `calibrate` message (`wait_for_turn`). A
worker that takes its rates from a profile or a predecessor, or does not calibrate, or
fails, never waits; a restarted worker is started without the cue (the others serve, so
there is no start-up to keep it from).
"""

from __future__ import annotations

import time

from minivllm.serving.transport import Endpoint

TURN_STAGE = "waiting to calibrate"
TURN_OP = "calibrate"


class StoppedBeforeReady(Exception):
    """The controller shut the worker down while it waited for its turn."""


def wait_for_turn(endpoint: Endpoint) -> list[dict]:
    """Worker side: announce the wait and block until the controller's `calibrate`.
    Returns any other message that arrived meanwhile, for the worker to handle once it
    serves; raises StoppedBeforeReady on `shutdown`."""
    endpoint.send({"op": "loading", "stage": TURN_STAGE})
    early = []
    while True:
        msg = endpoint.recv(None)
        op = msg.get("op")
        if op == TURN_OP:
            return early
        if op == "shutdown":
            raise StoppedBeforeReady
        early.append(msg)


def start_in_turns(handles: list, timeout_s: float) -> None:
    """Controller side: start every handle, wait until each is waiting for its turn (or
    ready, or down), then give the turns in order, each after the previous worker is ready.
    Returns at the latest after `timeout_s`; the caller reads the handles' states."""
    deadline = time.monotonic() + timeout_s

    def left() -> float:
        return max(0.0, deadline - time.monotonic())

    for handle in handles:
        handle.start()
    for handle in handles:
        handle.wait_settled(left())
    for handle in handles:
        if handle.stage == TURN_STAGE and handle.state == "starting":
            handle.give_turn()
        handle.wait_ready(left())
