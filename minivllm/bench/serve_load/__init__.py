"""`minivllm bench serve`: an online load generator for any OpenAI-compatible server.

It sends `num_prompts` streamed requests (`stream: true`, `stream_options.include_usage`)
to /v1/completions or /v1/chat/completions of a running server (minivllm, vLLM,
llama-cpp-python, llama.cpp's server, ...), arriving as a Poisson process or in bursts, at
most `max_concurrency` in flight, and reports the serving metrics with the usual
definitions (those of vLLM's benchmark_serving.py):

    TTFT        first content chunk - send                      (per request)
    ITL         gaps between consecutive content chunks         (pooled over requests)
    TPOT        (E2E - TTFT) / (output_tokens - 1)              (per request; 1-token requests skipped)
    E2E         end of the stream - send                        (per request)
    request throughput        completed requests / duration
    output token throughput   total output tokens / duration
    total token throughput    (total prompt + output tokens) / duration
    goodput                   requests meeting every SLO given (TTFT <= slo_ttft, TPOT <= slo_tpot) / duration

each latency as mean, median, p90, p99, std (population, as numpy.std) in the JSON; the
table shows mean, median, p99 and std. "Send" is when the request leaves the client (after
it waits for its arrival time and for a free `max_concurrency` slot); "duration" runs from
the first arrival to the end of the last request. A "content chunk" is an SSE chunk whose
`choices` list is not empty (a token's text, possibly empty, or the finish reason; the
usage-only chunk does not count), as in vLLM's benchmark. Output tokens come from the
server's `usage.completion_tokens` (else: the content chunks that carry a token, marked so);
prompt tokens from `usage.prompt_tokens` (else the requested input length, marked so).

A request fails on a non-200 answer, an error chunk inside the stream, a transport error
or timeout, or a stream with no content chunk or that ends without `[DONE]` and without
a finish_reason. Failed requests are counted (with the first few error messages) and left
out of every metric.

Prompts: synthetic text of random common English words, one seeded list shared by every
server in a run. With a local tokenizer (`--tokenizer` MODEL, or the model of
`--start-server`) each prompt is cut to exactly the requested number of tokens (the server
may add a BOS, and the chat endpoint adds its template); without one the input length is
approximate: one word per token (these common words are one token each with SmolLM2's
tokenizer, and with most BPE vocabularies; general prose runs nearer 1.3 tokens per word).
The actual prompt tokens come back in `usage` and are what the table reports. Requests are
greedy (temperature 0) and `ignore_eos` by default, so output lengths match `--max-tokens`
on servers that honour `ignore_eos` or `min_tokens` (minivllm, vLLM, llama-cpp-python); the summary
counts requests whose output length differs from the requested one.

Usage:

    # one server already running
    minivllm bench serve --url http://127.0.0.1:8000 --label minivllm \\
        --num-prompts 200 --request-rate 4 --max-concurrency 16 --prompt-tokens 128 --max-tokens 128

    # start `python -m minivllm serve` here, load it, stop it
    minivllm bench serve --start-server --model smollm2-135m --inference-device cpu:1 \\
        --num-prompts 20 --request-rate 2 --max-tokens 32

    # bursts, uniform lengths, SLOs (goodput), chat endpoint
    minivllm bench serve --url http://127.0.0.1:8000 --endpoint chat --arrival burst --burst-size 16 \\
        --burst-gap-s 5 --prompt-tokens-range 32:256 --max-tokens-range 16:128 --slo-ttft-ms 500 --slo-tpot-ms 50

    # several servers, one after another, identical seeded requests; ratios vs the first label
    minivllm bench serve --url http://127.0.0.1:8000 --label minivllm \\
        --url http://127.0.0.1:8001 --label llama-cpp-python --num-prompts 100 --request-rate 2

Options: --model (the `model` field; default: the first id of GET /v1/models; repeatable,
one per --url, or one for all), --api-key, --endpoint completions|chat, --num-prompts,
--arrival poisson|burst, --request-rate (req/s of the Poisson process; inf, the default,
sends everything at once), --burst-size/--burst-gap-s, --max-concurrency, --prompt-tokens/
--max-tokens or --prompt-tokens-range A:B/--max-tokens-range A:B (uniform), --seed,
--[no-]ignore-eos, --temperature, --slo-ttft-ms/--slo-tpot-ms, --warmup (unmeasured
requests first, default 1), --tokenizer, --request-timeout, --out, --tag; --start-server
with --model (the model to serve), --inference-device (repeatable), --serve-arg (extra
`minivllm serve` arguments, repeatable, --serve-arg=--flag) and --ready-timeout. With
--start-server the started server is the first target (label "minivllm" unless --label
says otherwise) and any --url targets follow it.

Results: benchmarks/results/serve-<label>[-<tag>]-<stamp>.json (provenance of this client:
commit, local versions; the target URL, the server's /v1/models and /health answers, every
setting; the summary; every request's timings) and .md with the table; with several
targets also serve-compare-<label>-vs-<label>...[-<tag>]-<stamp>.json/.md with one table,
a column per label and a ratio column per label against the first. The command prints
the table and exits 1 when a target completed no request at all.
"""

from minivllm.bench.serve_load.client import drive, endpoint_path, probe, stream_request
from minivllm.bench.serve_load.load import default_label, run
from minivllm.bench.serve_load.metrics import (
    RequestResult,
    meets_slo,
    peak_in_flight,
    request_metrics,
    stats,
    summarize,
)
from minivllm.bench.serve_load.report import markdown, table
from minivllm.bench.serve_load.workload import LoadSettings, RequestSpec, arrival_offsets, make_requests, request_body

__all__ = [
    "LoadSettings",
    "RequestResult",
    "RequestSpec",
    "arrival_offsets",
    "default_label",
    "drive",
    "endpoint_path",
    "make_requests",
    "markdown",
    "meets_slo",
    "peak_in_flight",
    "probe",
    "request_body",
    "request_metrics",
    "run",
    "stats",
    "stream_request",
    "summarize",
    "table",
]
