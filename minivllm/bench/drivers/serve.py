"""`minivllm bench serve`: the online load generator (minivllm/bench/serve_load/)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from minivllm.bench import common
from minivllm.bench.driver import Driver

length_range = common.range_type(":", int, 1)


@dataclass
class Settings:
    url: list[str] | None
    label: list[str] | None
    model: list[str] | None
    api_key: str | None
    endpoint: str
    num_prompts: int
    arrival: str
    request_rate: float
    burst_size: int
    burst_gap_s: float
    max_concurrency: int | None
    prompt_tokens: int
    max_tokens: int
    prompt_tokens_range: tuple[int, int] | None
    max_tokens_range: tuple[int, int] | None
    seed: int
    ignore_eos: bool
    temperature: float
    slo_ttft_ms: float | None
    slo_tpot_ms: float | None
    warmup: int
    tokenizer: str | None
    request_timeout: float
    start_server: bool
    inference_device: list[str] | None
    backend: list[str] | None
    serve_arg: list[str]
    start_peer: str | None
    peer_threads: int | None
    peer_gpu_layers: int
    llama_cpp_path: str | None
    ready_timeout: float
    out: str | None
    tag: str | None


def add_arguments(p) -> None:
    p.add_argument("--url", action="append", default=None,
                   help="server base URL, e.g. http://127.0.0.1:8000 (repeatable: servers run one after another "
                        "with the same requests); required unless --start-server")
    p.add_argument("--label", action="append", default=None,
                   help="a name per server, in the order of the servers (the started one first), e.g. minivllm, "
                        "llama-cpp-python (default: host-port; minivllm for --start-server)")
    common.add_model(p, default=None, repeatable=True,
                     help="the `model` field to send (default: the first id of GET /v1/models); one for all --url "
                          "targets or one per --url; with --start-server the first value is the model to serve")
    p.add_argument("--api-key", default=None)
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--arrival", choices=["poisson", "burst"], default="poisson")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrivals per second (default inf: all at once)")
    p.add_argument("--burst-size", type=int, default=10, help="requests per burst (--arrival burst)")
    p.add_argument("--burst-gap-s", type=float, default=1.0, help="seconds between bursts (--arrival burst)")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    common.add_prompt_tokens(p, 128, "prompt tokens (approximate without a tokenizer)")
    common.add_max_tokens(p, 128, "max_tokens of every request")
    p.add_argument(
        "--prompt-tokens-range", type=length_range, default=None, metavar="A:B", help="uniform prompt length"
    )
    p.add_argument("--max-tokens-range", type=length_range, default=None, metavar="A:B", help="uniform max_tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos so output lengths match (default on)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput SLO on TTFT")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput SLO on TPOT")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured warm-up requests per server (default 1)")
    p.add_argument("--tokenizer", default=None,
                   help="local model (name or .gguf) whose tokenizer sizes the prompts exactly "
                        "(default: the --start-server model; else lengths are approximate, by words)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="client timeout per request, seconds")
    p.add_argument("--start-server", action="store_true",
                   help="start `python -m minivllm serve --model MODEL` here, load it, stop it")
    common.add_inference_device(p, default=None, repeatable=True,
                                help="with --start-server: serve's --inference-device (repeatable)")
    p.add_argument("--backend", action="append", choices=("local", "ray"), default=None,
                   help="with --start-server: serve's --backend; repeat it (--backend local --backend ray) to start "
                        "one server per backend, one after another, with the same requests (ray: a private Ray "
                        "instance on this machine)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="with --start-server: extra `minivllm serve` argument (repeatable; --serve-arg=--flag)")
    p.add_argument("--start-peer", choices=["llama-cpp-python"], default=None,
                   help="with --start-server: then start llama-cpp-python's server on the same GGUF file and load "
                        "it with the same requests (`make peers` installs it from its sdist)")
    p.add_argument("--peer-threads", type=int, default=None, help="--start-peer's CPU threads (default: all cores)")
    p.add_argument("--peer-gpu-layers", type=int, default=0, help="--start-peer's n_gpu_layers (default 0: CPU)")
    p.add_argument("--llama-cpp-path", default=None, help="site-packages holding llama-cpp-python, if not this env's")
    p.add_argument(
        "--ready-timeout", type=float, default=900.0, help="with --start-server: seconds to wait for /health"
    )
    common.add_out(p)
    p.add_argument("--tag", default=None, help="result files serve-<label>-<tag>-<stamp>")


def run(s: Settings) -> int:
    from minivllm.bench.serve_load import LoadSettings, run

    if not s.url and not s.start_server:
        raise SystemExit("minivllm bench serve: give --url URL (repeatable) or --start-server --model MODEL")
    models = list(s.model or [])
    start_model = None
    if s.start_server:
        start_model = models.pop(0) if models else "smollm2-135m"
    try:
        settings = LoadSettings(
            endpoint=s.endpoint, num_prompts=s.num_prompts, arrival=s.arrival, request_rate=s.request_rate,
            burst_size=s.burst_size, burst_gap_s=s.burst_gap_s, max_concurrency=s.max_concurrency,
            input_len=s.prompt_tokens, output_len=s.max_tokens, input_len_range=s.prompt_tokens_range,
            output_len_range=s.max_tokens_range, seed=s.seed, ignore_eos=s.ignore_eos, temperature=s.temperature,
            slo_ttft_ms=s.slo_ttft_ms, slo_tpot_ms=s.slo_tpot_ms, request_timeout_s=s.request_timeout)
        result = run(s.url, s.label, settings, models=models, api_key=s.api_key, start_server=start_model,
                     inference_devices=s.inference_device, serve_args=s.serve_arg, tokenizer=s.tokenizer,
                     warmup=s.warmup, out_dir=s.out, tag=s.tag, ready_timeout_s=s.ready_timeout,
                     start_peer=s.start_peer, peer_threads=s.peer_threads, peer_gpu_layers=s.peer_gpu_layers,
                     llama_cpp_path=s.llama_cpp_path, backends=s.backend)
    except (ValueError, RuntimeError) as exc:  # bad settings; a server that fails its warm-up or start-up
        msg = str(exc)
        raise SystemExit(msg if msg.startswith("bench serve") else f"bench serve: {msg}") from None
    return 0 if all(t["summary"]["completed"] > 0 for t in result["targets"]) else 1


DRIVER = Driver("serve", "online load test of any OpenAI-compatible server: streamed requests with Poisson or burst "
                "arrivals; TTFT, TPOT, ITL, E2E, throughput, goodput; several servers compared",
                add_arguments, Settings, run)
