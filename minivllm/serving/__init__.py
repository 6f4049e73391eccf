"""Serving: one worker process per device, a router in front, an OpenAI-compatible API.

    with Cluster(model="smollm2-135m", devices=["cpu", "cpu"], router="cost") as cluster:
        for event in cluster.submit("Once upon a time", SamplingParams(max_tokens=32)):
            print(event.text, end="")

The HTTP server (`minivllm serve`) is a thin layer over the same `Cluster`.

How the package works (the design notes that ARCHITECTURE.md used to carry):

One worker process per `--inference-device` entry (`inference_devices.py` resolves the
list at once: explicit `cuda:N` first, `gpu` claims the next free index, CPU threads
default to the cores not reserved for GPU workers and the controller). `transport.py` is
the only controller↔worker link: `WorkerTransport` (send, recv, alive, kill, close) over
JSON dicts (`protocol.py`); `ProcessTransport` starts `python -m minivllm.serving.worker
FD` on one end of a socket pair (not multiprocessing's spawn, which re-imports the
user's `__main__`). The worker (`worker.py`) loads its `LLM`, warms up, calibrates
(`calibration.py`), then runs a step loop that applies submissions/aborts between steps
and sends token events, a per-step `progress` message (running ids and prompt progress)
and a snapshot every 0.25 s; a receiver thread answers prefix-cache queries at once (a
read-only lookup) and a heartbeat thread reports the loop's age. `WorkerHandle` is the
controller's side: a reader thread turning messages into `RequestStream` events, the
in-flight ledger (prompt size, routing-time cache estimate, budget, tokens so far) and
death detection (closed pipe, dead process, heartbeat silence, or a step loop stalled
while the heartbeat goes on; a hung worker is killed, a dead one reaped), which fails every
in-flight request with an error naming the worker. `worker_recovery.py`'s
`WorkerSupervisor` restarts a dead worker by itself, through the same serialised restart
as `restart_worker`, after a backoff and at most `max_worker_restarts` times in 10
minutes, and counts restarts per worker (snapshot, health, metrics). `Cluster.inject_fault` runs the crash / freeze
/ hang drills. `Router` holds the policies and a ring buffer of decisions with every
candidate's inputs and terms; `worker_rates.py` is the rate model (aggregate prefill
tok/s and decode tok/s per batch size, corrected online per batch size from each step).
A split request (issue 43: `submit(placement=(A, B))` or the `cost+split` router)
is served by two workers as one request: `split_request.py` (the controller's side,
standing in both ledgers for the client's stream), `kv_segment.py` (the K/V in a
shared-memory segment that the controller names, so it can always unlink it),
`link_rate.py` (that copy's rate, measured at start-up and corrected by each handoff)
and `split_pricing.py` (the router's split candidates).
`Cluster` resolves the model once, starts the workers, serialises routing (so each
decision sees the ones before it), validates requests before routing, and offers
`submit`, `snapshot`, `health`, `restart_worker`, `kill_worker`, `set_router`. Restarts
are serialised per worker (`restart_worker_async` hands a call the restart in progress,
so the HTTP route awaits it without a thread), every handle the cluster spawns is
tracked and reaped by `stop`. Admission is work-aware: `_admissible` drops workers whose
queued prompt work (the in-flight requests' remaining prefill) plus the new prompt would
pass `max_queued_prompt_tokens` (a worker with none queued takes any prompt that fits)
and raises `AdmissionRefused` (429) when none is left. Chat prompts go through
`Tokenizer.encode_chat`: control-token text inside message content is escaped
before rendering (`gguf/control_escape.py`), the rendered prompt is split at the control
tokens the template wrote and the runs between them are encoded as plain text, so
content never yields control ids (benign content takes the old render-then-encode path,
ids unchanged); raw string prompts parse control tokens unless
`prompt_special_tokens=False`. `http_api.py` is the FastAPI app over a `Cluster`;
`http_guards.py` holds the API key, body-size and concurrency limits as pure ASGI
middlewares (Starlette's `BaseHTTPMiddleware` would hide client disconnects);
`request_accounting.py` is the ledger of accepted requests and their one terminal event
each (open, ended by reason, duplicates); `metrics.py` the Prometheus registry (request
histograms observed by the API, engine gauges and counters collected from snapshots at
scrape time); `http_connections.py` subclasses uvicorn's h11 protocol for a header-read
timeout (a connection waiting for a request gets a 408 and is closed when its headers
are not complete in time, re-armed after every response) and an open-connection cap (503
and close at accept); `http_server.py` runs uvicorn blocking or on a background thread
with that protocol
"""

from minivllm.serving.cluster import Cluster, RequestStream
from minivllm.serving.inference_devices import InferenceDevice, parse_inference_devices
from minivllm.serving.router import ROUTER_POLICIES

__all__ = ["Cluster", "RequestStream", "InferenceDevice", "parse_inference_devices", "ROUTER_POLICIES"]
