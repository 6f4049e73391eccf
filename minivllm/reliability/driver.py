"""`minivllm bench soak`'s flags and settings, registered with the benchmark drivers (see soak.py
for why the command keeps that name)."""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.bench import common
from minivllm.bench.driver import Driver

count_range, seconds_range = common.range_type(",", int, 1), common.range_type(",", float, 0)


@dataclass
class Settings:
    model: str
    inference_device: list[str] | None
    url: str | None
    requests: int
    seed: int
    cancel_fraction: float
    disconnect_fraction: float
    max_tokens: int
    min_prompt_tokens: int
    max_prompt_tokens: int
    stream_fraction: float
    chat_fraction: float
    burst: tuple[int, int]
    gap: tuple[float, float]
    trickle_rate: float
    drain_to: int
    max_model_len: int
    max_active_requests: int
    page_size: int | None
    router: str | None
    api_key: str | None
    serve_arg: list[str]
    max_rss_growth: float
    max_duration: float | None
    request_timeout: float
    idle_timeout: float
    ready_timeout: float
    out: str | None
    tag: str | None


def add_arguments(p) -> None:
    common.add_model(p)
    common.add_inference_device(p, default=None, repeatable=True,
                                help="repeatable: a serve worker per entry (default: cpu:1 twice)")
    p.add_argument("--url", default=None, help="soak an already-running server instead of starting one")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cancel-fraction", type=float, default=0.2, help="requests cancelled at a random moment")
    p.add_argument("--disconnect-fraction", type=float, default=0.1,
                   help="requests streamed and disconnected after a random number of chunks")
    common.add_max_tokens(p, 48, "each request's max_tokens is drawn from 1..this")
    p.add_argument("--min-prompt-tokens", type=int, default=5)
    p.add_argument("--max-prompt-tokens", type=int, default=300)
    p.add_argument("--stream-fraction", type=float, default=0.5, help="of the requests that do not disconnect")
    p.add_argument("--chat-fraction", type=float, default=0.5)
    p.add_argument("--burst", type=count_range, default=(10, 60), metavar="MIN,MAX", help="requests per burst")
    p.add_argument("--gap", type=seconds_range, default=(0.5, 3.0), metavar="MIN,MAX", help="idle gap in seconds")
    p.add_argument("--trickle-rate", type=float, default=2.0, help="Poisson arrivals per second during gaps")
    p.add_argument("--drain-to", type=int, default=0,
                   help="after a burst, wait until at most this many requests are in flight")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-active-requests", type=int, default=8, help="per worker")
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--router", default=None, help="serve's --router (default: serve's own)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `minivllm serve` (repeatable; use --serve-arg=--flag)")
    p.add_argument("--max-rss-growth", type=float, default=1.5,
                   help="fail when a process's last-quarter mean RSS exceeds its first-quarter mean by this factor "
                        "(0: report only)")
    p.add_argument("--max-duration", type=float, default=None,
                   help="stop sending new requests after this many seconds (the soak then checks those sent)")
    p.add_argument("--request-timeout", type=float, default=900.0, help="client timeout per request, seconds")
    p.add_argument("--idle-timeout", type=float, default=120.0, help="how long to wait for the server to go idle")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="how long to wait for the server to start")
    common.add_out(p)
    p.add_argument("--tag", default=None, help="result files soak-<tag>-<stamp> (default <devices>-<model>)")


def run(s: Settings) -> int:
    from minivllm.reliability.soak import SoakSettings, run

    settings = SoakSettings(requests=s.requests, seed=s.seed, cancel_fraction=s.cancel_fraction,
                            disconnect_fraction=s.disconnect_fraction, max_new_tokens=s.max_tokens,
                            min_prompt_tokens=s.min_prompt_tokens, max_prompt_tokens=s.max_prompt_tokens,
                            stream_fraction=s.stream_fraction, chat_fraction=s.chat_fraction, burst=s.burst,
                            gap_s=s.gap, trickle_rate=s.trickle_rate, drain_to=s.drain_to,
                            max_duration_s=s.max_duration, request_timeout_s=s.request_timeout,
                            idle_timeout_s=s.idle_timeout, max_rss_growth=s.max_rss_growth or None)
    result = run(s.model, s.inference_device, url=s.url, settings=settings, max_model_len=s.max_model_len,
                 page_size=s.page_size, max_active_requests=s.max_active_requests, router=s.router,
                 api_key=s.api_key, serve_args=s.serve_arg, out_dir=s.out, tag=s.tag, ready_timeout_s=s.ready_timeout)
    return 0 if result["ok"] else 1


DRIVER = Driver("soak", "thousands of mixed, bursty, partly cancelled requests against a real `minivllm serve`; "
                "then checks the request ledger, idle engines, free KV pages and RSS", add_arguments, Settings, run)
