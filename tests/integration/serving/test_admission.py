"""Work-aware admission: a per-worker bound on queued prompt tokens, beside the request count.

One real worker (SmolLM2-135M, one CPU thread) behind the real HTTP server, with
max_queued_prompt_tokens=450. The worker process is held with SIGSTOP while requests
are routed, so what is queued does not depend on how fast the machine prefills (the
heartbeat timeout is long enough that the controller does not declare it dead), then
resumed with SIGCONT. Reference: the prompt lengths from the tokenizer and the
controller's own ledger.

- a ~400-token prompt on an empty queue is taken (a long prompt is never refused outright);
- a second one gets a 429 naming the limit and the flag, with Retry-After;
- a short prompt that still fits is taken; both taken requests then finish normally.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from minivllm.errors import ConfigError
from minivllm.sampling.sampling_params import SamplingParams
from minivllm.serving import Cluster
from minivllm.serving.cluster import AdmissionRefused
from minivllm.serving.http_server import start_server_in_background

LIMIT = 450
DEADLINE_S = 120.0  # liveness only

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def wait_for(predicate, what: str, timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.02)


def test_queued_prompt_tokens_bound_admission(smollm2_path):
    cluster = Cluster(str(smollm2_path), ["cpu:1"], router="round-robin", max_model_len=512, calibrate=False,
                      max_queued_prompt_tokens=LIMIT, heartbeat_timeout_s=600.0).start()
    srv = start_server_in_background(cluster)
    handle = cluster.workers["cpu"]
    long_prompt = " ".join(f"item{i}" for i in range(130))
    n_long = len(cluster.tokenizer.encode(long_prompt))
    assert LIMIT - 60 < n_long <= LIMIT < 2 * n_long
    try:
        os.kill(handle.transport.pid, signal.SIGSTOP)

        async def drill():
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                def complete(prompt):
                    return client.post(
                        srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0}
                    )

                first = asyncio.create_task(complete(long_prompt))
                await asyncio.to_thread(wait_for, lambda: len(handle.in_flight) == 1, "the first prompt to be routed")
                refused = await complete(long_prompt + " again")
                # the Python API refuses the same way, with the same error
                with pytest.raises(AdmissionRefused, match="max-queued-prompt-tokens"):
                    cluster.submit(long_prompt, SamplingParams(max_tokens=2))
                short = asyncio.create_task(complete("Hi there"))
                await asyncio.to_thread(wait_for, lambda: len(handle.in_flight) == 2, "the short prompt to be routed")
                os.kill(handle.transport.pid, signal.SIGCONT)
                return refused, await first, await short

        refused, first, short = asyncio.run(drill())
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1", refused.text
        err = refused.json()["error"]
        assert err["type"] == "rate_limit_error"
        assert f"has {n_long} prompt tokens queued" in err["message"] and str(LIMIT) in err["message"]
        assert "--max-queued-prompt-tokens" in err["message"]
        for r in (first, short):
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
        assert first.json()["usage"]["prompt_tokens"] == n_long
        snap = cluster.snapshot()
        assert snap["admission"] == {"max_queued_prompt_tokens": LIMIT, "refused": 2}
        assert snap["requests"]["open"] == 0
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'minivllm_rejected_requests_total{reason="queued_tokens"} 1.0' in metrics
        # With the queue drained, the long prompt is taken again.
        again = httpx.post(srv.url + "/v1/completions", timeout=DEADLINE_S,
                           json={"prompt": long_prompt + " again", "max_tokens": 2})
        assert again.status_code == 200, again.text
    finally:
        if handle.transport.alive():
            os.kill(handle.transport.pid, signal.SIGCONT)
        srv.stop()
        cluster.stop()


@pytest.mark.parametrize("value", [0, -3, 1.5, True, "100"])
def test_bad_limits_are_refused_by_name(smollm2_path, value):
    with pytest.raises(ConfigError, match="max_queued_prompt_tokens"):
        Cluster(str(smollm2_path), ["cpu:1"], max_queued_prompt_tokens=value)
