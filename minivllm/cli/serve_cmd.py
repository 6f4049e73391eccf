"""`minivllm serve`: worker processes behind a router, served over the OpenAI-compatible API."""

from __future__ import annotations

import argparse
import sys

from minivllm.devices import DTYPE_CHOICES
from minivllm.engine.options import add_engine_flags, engine_options_from_args
from minivllm.models import DEFAULT_MODEL
from minivllm.serving.cluster import DEFAULT_MAX_QUEUED_PROMPT_TOKENS
from minivllm.serving.http_guards import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_CONCURRENT_REQUESTS,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_REQUEST_BYTES,
)
from minivllm.serving.worker_handle import DEFAULT_HEARTBEAT_TIMEOUT_S, DEFAULT_STALL_TIMEOUT_S
from minivllm.serving.worker_recovery import (
    BACKOFF_FIRST_S,
    BACKOFF_MAX_S,
    DEFAULT_MAX_WORKER_RESTARTS,
    RESTART_WINDOW_S,
)


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    """What every command that starts a Cluster takes (serve, smoke)."""
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"registered name or .gguf path (default {DEFAULT_MODEL})")
    p.add_argument("--inference-device", action="append", default=None,
                   help="repeatable: cpu, cpu:THREADS, gpu (next unclaimed CUDA index) or cuda:N; one worker "
                        "process per entry (default: one cpu worker). With --backend ray: cpu[:N] or gpu, "
                        "optionally node=ADDR:... to pin it to a Ray node (its IP or node-id prefix)")
    p.add_argument("--backend", choices=("local", "ray"), default="local",
                   help="local (default): worker processes on this machine; ray: Ray actors on the nodes of a "
                        "Ray cluster (pip install 'minivllm[ray]')")
    p.add_argument("--pin-cpus", action="store_true",
                   help="local backend: each CPU worker on cores of its own, one per physical core first, the GPU "
                        "workers on the rest (off by default until measured; serving/cpu_placement.py)")
    p.add_argument("--ray-address", default="auto",
                   help="with --backend ray: the cluster to join (default auto: the one this machine belongs to, or "
                        "RAY_ADDRESS; ray://HOST:10001 through Ray Client; 'local' starts a private one here)")
    p.add_argument("--activation-dtype", default="auto", choices=("auto",) + DTYPE_CHOICES,
                   help="auto (default): f32 on CPU workers, f16 on GPU workers")
    p.add_argument("--rates-profile", default=None,
                   help="JSON file with each worker's prefill/decode rates, instead of calibrating at start")
    p.add_argument("--heartbeat-timeout", type=float, default=DEFAULT_HEARTBEAT_TIMEOUT_S,
                   help="seconds of silence after which a worker is declared dead and killed "
                        f"(default {DEFAULT_HEARTBEAT_TIMEOUT_S:g})")
    p.add_argument("--stall-timeout", type=float, default=DEFAULT_STALL_TIMEOUT_S,
                   help="seconds a worker's step loop may stay stuck while its heartbeat goes on before it is "
                        f"declared hung and killed (default {DEFAULT_STALL_TIMEOUT_S:g})")
    p.add_argument("--max-worker-restarts", type=int, default=DEFAULT_MAX_WORKER_RESTARTS,
                   help="a worker that dies or is killed as hung restarts by itself, after a backoff "
                        f"({BACKOFF_FIRST_S:g} s, doubling to {BACKOFF_MAX_S:g} s), at most this many times in "
                        f"{RESTART_WINDOW_S:g} s; then it stays down until restarted by hand (0: never "
                        f"automatically; default {DEFAULT_MAX_WORKER_RESTARTS})")
    p.add_argument("--max-queued-prompt-tokens", type=int, default=DEFAULT_MAX_QUEUED_PROMPT_TOKENS,
                   help="per worker: prompt tokens still to prefill for its requests; a request that would pass it "
                        "goes to another worker or gets a 429 (a worker with none queued takes any prompt that "
                        f"fits; 0: no limit; default {DEFAULT_MAX_QUEUED_PROMPT_TOKENS})")


def add_serve_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API over one worker per device")
    add_cluster_arguments(p)
    p.add_argument("--router", default="cost",
                   help="round-robin, least-loaded, cost (default), cost+split (cost, also pricing prefill on one "
                        "worker and decode on another) or forced:<worker> (e.g. forced:cuda:0)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="repeatable; without --api-key, a Host name (besides loopback and the bind address) that "
                        "clients may use; other Host values and cross-site browser requests get a 403")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help=f"larger request bodies get a 413 (default {DEFAULT_MAX_REQUEST_BYTES})")
    p.add_argument("--max-concurrent-requests", type=int, default=DEFAULT_MAX_CONCURRENT_REQUESTS,
                   help="generation requests at once, streams included; more get a 429 "
                        f"(default {DEFAULT_MAX_CONCURRENT_REQUESTS})")
    p.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                   help="seconds a connection waiting for a request may take to send complete headers, and then "
                        "its body, before it gets a 408 and is closed; slow and idle clients cannot hold sockets "
                        f"(default {DEFAULT_HEADER_TIMEOUT_S:g})")
    p.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                   help="open HTTP connections at once; more get a 503 and are closed at accept "
                        f"(default {DEFAULT_MAX_CONNECTIONS})")
    p.add_argument(
        "--prompt-special-tokens",
        choices=("parse", "text"),
        default="parse",
        help="raw /v1/completions string prompts: 'parse' (default, as llama.cpp and vLLM) turns control-token "
        "text such as <|im_start|> into control tokens; 'text' keeps it plain text. Chat message "
        "content is always plain text",
    )
    add_engine_flags(p)
    p.set_defaults(func=run_serve)


def cluster_kwargs(args: argparse.Namespace) -> dict:
    return {"devices": args.inference_device or ["cpu"], "dtype": args.activation_dtype,
            "backend": args.backend, "ray_address": None if args.ray_address == "local" else args.ray_address,
            "pin_cpus": args.pin_cpus,
            "draft_model": args.draft_model, "rates_profile": args.rates_profile,
            "heartbeat_timeout_s": args.heartbeat_timeout, "stall_timeout_s": args.stall_timeout,
            "max_worker_restarts": args.max_worker_restarts,
            "max_queued_prompt_tokens": args.max_queued_prompt_tokens or None, **engine_options_from_args(args)}


def run_serve(args: argparse.Namespace) -> int:
    from minivllm.serving import Cluster
    from minivllm.serving.http_guards import ServerLimits
    from minivllm.serving.http_server import serve

    if args.host not in ("127.0.0.1", "localhost", "::1") and args.api_key is None:
        print(f"warning: serving on {args.host} without --api-key: anyone who can reach it can use it (clients must "
              "use the bind address or a --allowed-host as the Host)", file=sys.stderr)

    limits = ServerLimits(
        max_request_bytes=args.max_request_bytes,
        max_concurrent_requests=args.max_concurrent_requests,
        header_timeout_s=args.header_timeout,
        max_connections=args.max_connections,
    )

    def progress(name, state, stage):
        print(f"[{name}] {state}: {stage}", file=sys.stderr)

    cluster = Cluster(args.model, router=args.router, on_progress=progress, progress=True,
                      prompt_special_tokens=args.prompt_special_tokens == "parse", **cluster_kwargs(args))
    with cluster:
        for w in cluster.snapshot()["workers"]:
            r = w["rates"]
            print(f"[{w['name']}] ready: prefill {r.get('prefill_tps') or 0:.1f} tok/s, decode "
                  + ", ".join(f"batch {b}: {v:.1f}" for b, v in (r.get("decode_tps") or {}).items()) + " tok/s",
                  file=sys.stderr)
        serve(cluster, host=args.host, port=args.port, api_key=args.api_key, limits=limits,
              allowed_hosts=tuple(args.allowed_host))
    return 0
