"""`minivllm bench ...`: benchmark drivers that write benchmarks/results/*.json + .md."""

from __future__ import annotations

import argparse


def add_bench_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="run a benchmark and write results to benchmarks/results/")
    sub = p.add_subparsers(dest="bench", required=True)

    al = sub.add_parser("all", help="run every benchmark, each as its own subprocess; write an index "
                        "(benchmarks/results/bench-all-<devices>-<stamp>.json/.md); exit 1 if any failed")
    al.add_argument("--quick", action="store_true", help="small models, few tokens, 1 run (checks every driver)")
    al.add_argument("--device", action="append", default=None,
                    help="repeatable: cpu, cuda:N (default: cuda:0 when CUDA is available, else cpu)")
    al.add_argument("--only", type=_names, default=None, help="comma list of benchmark names to run")
    al.add_argument("--skip", type=_names, default=None, help="comma list of benchmark names to leave out")
    al.add_argument("--dry-run", action="store_true", help="print the planned commands; run nothing")
    al.add_argument("--timeout", type=float, default=None, help="seconds per benchmark before it is killed")
    al.set_defaults(func=_all)

    g = sub.add_parser("gguf-open", help="time opening GGUF files (metadata, index, tokenizer)")
    g.add_argument("--model", action="append", default=None, help="model name or path (repeatable)")
    g.add_argument("--repeats", type=int, default=5)
    g.add_argument("--baseline", action="store_true", help="also time gguf.GGUFReader")
    g.set_defaults(func=_gguf_open)

    d = sub.add_parser("decode", help="batch-1 decode and 512-token prefill speed; on CPU also llama.cpp and transformers")
    d.add_argument("--model", default="smollm2-135m")
    d.add_argument("--inference-device", action="append", default=None, help="repeatable: cpu, gpu, cuda:N")
    d.add_argument("--activation-dtype", action="append", default=None, help="repeatable: f32, f16, bf16")
    d.add_argument("--max-tokens", type=int, default=64, help="decode tokens per run")
    d.add_argument("--prompt-tokens", type=int, default=512, help="prompt length for the prefill measurement")
    d.add_argument("--repeats", type=int, default=3, help="rounds of every engine (at least)")
    d.add_argument("--max-repeats", type=int, default=None,
                   help="more rounds while any engine's decode tok/s CV exceeds 5%%, up to this (default 3 x --repeats)")
    d.add_argument("--threads", type=int, default=None, help="torch and llama.cpp threads (default 2 on CPU)")
    d.add_argument("--llama-cpp-path", default=None,
                   help="site-packages holding llama-cpp-python (default: $MINIVLLM_LLAMA_CPP_PATH, else the environment)")
    d.add_argument("--no-baselines", action="store_true", help="skip llama.cpp and transformers on CPU")
    d.add_argument("--synthetic", default=None, choices=["qwen2.5-7b-q4_k_m", "qwen2.5-0.5b-q4_k_m"],
                   help="measure a synthetic model with this layout (random weights; written to the cache once; GPU)")
    d.add_argument("--synthetic-tokenizer", default=None,
                   help="Qwen2.5 GGUF to copy the synthetic model's tokenizer from (default: qwen2.5-coder-0.5b)")
    d.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="engine option for minivllm (repeatable), e.g. gemv_max_rows=0, enforce_eager=true")
    d.add_argument("--llama-bench", default=None, metavar="PATH",
                   help="a llama-bench binary (llama.cpp CUDA): run it on the same file after minivllm's rounds; "
                        "GPU rows get ratio_vs_llama_cpp")
    d.set_defaults(func=_decode)

    ad = sub.add_parser("activation-dtype", help="TTFT, decode tok/s and peak memory per activation dtype (f32, f16, "
                        "bf16), each dtype in a fresh process; ratios vs f32")
    ad.add_argument("--model", default="smollm2-135m")
    ad.add_argument("--inference-device", default="cpu", help="cpu, gpu, cuda:N")
    ad.add_argument("--activation-dtype", action="append", default=None,
                    help="repeatable: f32, f16, bf16 (default: every dtype the device supports)")
    ad.add_argument("--prompt-tokens", type=int, default=512, help="prompt length (TTFT)")
    ad.add_argument("--max-tokens", type=int, default=128, help="greedy tokens per run, EOS ignored (decode tok/s)")
    ad.add_argument("--repeats", type=int, default=3, help="timed runs per dtype (at least), after one warm-up")
    ad.add_argument("--max-repeats", type=int, default=None,
                    help="more runs while the decode tok/s CV exceeds 5%%, up to this (default 3 x --repeats)")
    ad.add_argument("--threads", type=int, default=None, help="torch threads on CPU (default 2)")
    ad.set_defaults(func=_activation_dtype)

    t = sub.add_parser("gemv-threshold",
                       help="aggregate tok/s for N requests: sequential, batched GEMM, batched row-wise GEMV")
    _common(t)
    t.add_argument("--concurrency", type=_ints, default=list(range(1, 9)), help="comma list of N (default 1..8)")
    t.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    t.add_argument("--batch-invariant", action="store_true", help="add a batched batch_invariant=True column")
    t.add_argument("--max-repeats", type=int, default=None,
                   help="per N, more rounds while any mode's tok/s CV exceeds 5%%, up to this (default 3 x --repeats)")
    t.set_defaults(func=_gemv_threshold)

    kn = sub.add_parser("kernels", help="Triton dequantize-GEMV GB/s per weight type on 7B shapes vs copy bandwidth (CUDA)")
    kn.add_argument("--types", type=lambda v: [x.strip().upper() for x in v.split(",") if x.strip()], default=None,
                    help="comma list of weight types (default: all with a GEMV kernel)")
    kn.add_argument("--shapes", type=_shapes, default=None, help="comma list of NxK (default: Qwen2.5-7B's four)")
    kn.add_argument("--inference-device", default="gpu", help="gpu or cuda:N")
    kn.add_argument("--batch-rows", type=int, default=8, help="M of the multi-row measurement (default 8)")
    kn.set_defaults(func=_kernels)

    c = sub.add_parser("continuous-batching",
                       help="aggregate tok/s batched vs sequential for N requests; paged vs contiguous decode")
    _common(c)
    c.add_argument("--concurrency", type=_ints, default=[1, 2, 3, 4, 5, 8], help="comma list of N (default 1,2,3,4,5,8)")
    c.add_argument("--max-tokens", type=int, default=64, help="output tokens per request in the batching runs")
    c.add_argument("--decode-lengths", type=_ints, default=None,
                   help="comma list of output lengths for paged vs contiguous (default 512,2048; 128,512 on CPU)")
    c.add_argument("--quick", action="store_true", help="decode lengths 128,512 (the CPU default)")
    c.add_argument("--max-batched-tokens", type=int, default=512)
    c.add_argument("--page-size", type=int, default=16)
    c.add_argument("--parts", type=lambda v: v.split(","), default=None,
                   help="comma list of experiments to run: batching, kv (default both)")
    c.add_argument("--max-repeats", type=int, default=None,
                   help="per row, more rounds while either mode's tok/s CV exceeds 5%%, up to this "
                        "(default 3 x --repeats)")
    c.set_defaults(func=_continuous_batching)

    pc = sub.add_parser("prefix-cache", help="the prefix-cache article's tables: warm-prefix TTFT, cold bursts, "
                        "incremental publication, single-flight release policies, distinct-input control")
    _common(pc)
    pc.add_argument("--parts", type=lambda v: v.split(","), default=None,
                    help="comma list: warm-prefix, cold-burst, incremental, single-flight, distinct (default all)")
    pc.add_argument("--groups", type=_ints, default=[2, 4, 8], help="request counts for incremental/single-flight")
    pc.add_argument("--output-tokens", type=int, default=None, help="tokens per request (default 128; 32 on CPU)")
    pc.add_argument("--max-batched-tokens", type=int, default=2048)
    pc.add_argument("--max-active-requests", type=int, default=8)
    pc.add_argument("--page-size", type=int, default=16)
    pc.add_argument("--synthetic", default=None, choices=["qwen2.5-7b-q4_k_m"],
                    help="a synthetic model with this layout instead of --model (random weights; GPU)")
    pc.add_argument("--synthetic-tokenizer", default=None, help="GGUF to copy the synthetic model's tokenizer from")
    pc.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="engine option for every case (repeatable), e.g. dequant_cache=true")
    pc.add_argument("--max-repeats", type=int, default=None,
                    help="per case, more runs (each on a fresh engine) while a watched TTFT or completion time's CV "
                         "exceeds 5%%, up to this (default 3 x --repeats)")
    pc.set_defaults(func=_prefix_cache)

    sp = sub.add_parser("speculative", help="speculative decoding: target-only vs fixed and adaptive draft lengths "
                        "(greedy, code and creative prompts) and mentored decoding's TV budgets (sampling)")
    sp.add_argument("--model", default="qwen2.5-coder-1.5b", help="the target model")
    sp.add_argument("--draft-model", default="qwen2.5-coder-0.5b")
    sp.add_argument("--inference-device", default="cpu", help="cpu, gpu, cuda:N")
    sp.add_argument("--activation-dtype", default="f32", help="f32, f16, bf16")
    sp.add_argument("--runs", type=int, default=3, help="timed runs per case (after a warm-up)")
    sp.add_argument("--max-runs", type=int, default=None,
                    help="per case, more runs (each of every seed) while a seed's e2e time CV exceeds 5%%, up to this "
                         "(default 3 x --runs)")
    sp.add_argument("--seeds", type=int, default=3, help="seeds per run in the sampling table")
    sp.add_argument("--max-tokens", type=int, default=256, help="generated tokens per request (EOS ignored)")
    sp.add_argument("--parts", type=lambda v: v.split(","), default=None, help="comma list: greedy, sampling")
    sp.add_argument("--prompts", type=lambda v: v.split(","), default=None, help="comma list: code, creative")
    sp.add_argument("--cases", type=lambda v: v.split(","), default=None,
                    help="greedy cases to run besides target-only (default all): fixed-4, fixed-6, fixed-8, "
                         "acceptance-rate, accepted-length, adaptive, draft-only")
    sp.add_argument("--sampling-policy", default="fixed:8",
                    help="draft policy of the TV-budget rows; several separated by / (fixed:4/fixed:8) each get every budget")
    sp.add_argument("--synthetic-pair", action="store_true",
                    help="synthetic Qwen2.5-7B Q4_K_M target + 0.5B-class draft, random weights (GPU cost study)")
    sp.add_argument("--synthetic-tokenizer", default=None, help="GGUF to copy the synthetic models' tokenizer from")
    sp.add_argument("--tv-budgets", type=lambda v: tuple(float(x) for x in v.split(",")), default=(0.0, 0.5, 0.75, 1.0))
    sp.add_argument("--temperature", type=float, default=0.7)
    sp.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="engine option for every case (repeatable), e.g. gemv_max_rows=16")
    sp.set_defaults(func=_speculative)

    ro = sub.add_parser("routing", help="routing policies on a burst with a warm shared prefix: forced onto the fastest "
                        "worker vs round-robin vs cost (completion time, throughput, TTFT, per-worker counts)")
    ro.add_argument("--model", default="smollm2-135m",
                    help="model name or path (default smollm2-135m; the article used qwen2.5-coder-0.5b)")
    ro.add_argument("--inference-device", action="append", default=None,
                    help="repeatable: cpu, cpu:THREADS, gpu, cuda:N (default: cpu:1 twice)")
    ro.add_argument("--bursts", type=_ints, default=None, help="comma list of burst sizes (default 8,48)")
    ro.add_argument("--policies", type=lambda v: [x.strip() for x in v.split(",") if x.strip()], default=None,
                    help="comma list: forced-fastest, round-robin, least-loaded, cost, forced:<worker> "
                         "(default forced-fastest,round-robin,cost)")
    ro.add_argument("--runs", type=int, default=None, help="runs per (policy, burst) (default 3)")
    ro.add_argument("--max-runs", type=int, default=None,
                    help="per (policy, burst), more runs while the completion time's CV exceeds 5%%, up to this "
                         "(default 3 x --runs)")
    ro.add_argument("--max-tokens", type=int, default=None, help="output tokens per request (default 128)")
    ro.add_argument("--prompt-tokens", type=int, default=None, help="prompt length in tokens (default 516)")
    ro.add_argument("--prefix-tokens", type=int, default=None,
                    help="shared, seeded prefix; a whole number of KV pages (default 496 = 31 pages of 16)")
    ro.add_argument("--arrival-ms", type=float, default=50.0, help="time between submissions (default 50)")
    ro.add_argument("--max-active", type=int, default=4, help="max_active_requests of every worker (default 4)")
    ro.add_argument("--dtype", "--activation-dtype", dest="dtype", default="f32", help="f32, f16, bf16")
    ro.add_argument("--fresh-per-run", action=argparse.BooleanOptionalAction, default=True,
                    help="a fresh cluster for every run (default; independent runs) or one per (policy, burst), "
                         "re-seeded per run (quicker; runs inherit rates, cursor and caches)")
    ro.add_argument("--quick", action="store_true",
                    help="tiny sizes for tests: bursts 4, 1 run, 8 output tokens, 64-token prompts, 48 shared")
    ro.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="engine option for every worker (repeatable), e.g. page_size=16, enforce_eager=true")
    ro.set_defaults(func=_routing)

    so = sub.add_parser("soak", help="thousands of mixed, bursty, partly cancelled requests against a real "
                        "`minivllm serve`; then checks the request ledger, idle engines, free KV pages and RSS")
    so.add_argument("--model", default="smollm2-135m")
    so.add_argument("--inference-device", action="append", default=None,
                    help="repeatable: a serve worker per entry (default: cpu:1 twice)")
    so.add_argument("--url", default=None, help="soak an already-running server instead of starting one")
    so.add_argument("--requests", type=int, default=2000)
    so.add_argument("--seed", type=int, default=0)
    so.add_argument("--cancel-fraction", type=float, default=0.2, help="requests cancelled at a random moment")
    so.add_argument("--disconnect-fraction", type=float, default=0.1,
                    help="requests streamed and disconnected after a random number of chunks")
    so.add_argument("--max-new-tokens", type=int, default=48, help="max_tokens is drawn from 1..this")
    so.add_argument("--min-prompt-tokens", type=int, default=5)
    so.add_argument("--max-prompt-tokens", type=int, default=300)
    so.add_argument("--stream-fraction", type=float, default=0.5, help="of the requests that do not disconnect")
    so.add_argument("--chat-fraction", type=float, default=0.5)
    so.add_argument("--burst", type=_int_range, default=(10, 60), metavar="MIN,MAX", help="requests per burst")
    so.add_argument("--gap", type=_float_range, default=(0.5, 3.0), metavar="MIN,MAX", help="idle gap in seconds")
    so.add_argument("--trickle-rate", type=float, default=2.0, help="Poisson arrivals per second during gaps")
    so.add_argument("--drain-to", type=int, default=0,
                    help="after a burst, wait until at most this many requests are in flight")
    so.add_argument("--max-model-len", type=int, default=1024)
    so.add_argument("--max-active-requests", type=int, default=8, help="per worker")
    so.add_argument("--page-size", type=int, default=None)
    so.add_argument("--router", default=None, help="serve's --router (default: serve's own)")
    so.add_argument("--api-key", default=None)
    so.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                    help="extra argument for `minivllm serve` (repeatable; use --serve-arg=--flag)")
    so.add_argument("--max-rss-growth", type=float, default=1.5,
                    help="fail when a process's last-quarter mean RSS exceeds its first-quarter mean by this factor "
                         "(0: report only)")
    so.add_argument("--max-duration", type=float, default=None,
                    help="stop sending new requests after this many seconds (the soak then checks those sent)")
    so.add_argument("--request-timeout", type=float, default=900.0, help="client timeout per request, seconds")
    so.add_argument("--idle-timeout", type=float, default=120.0, help="how long to wait for the server to go idle")
    so.add_argument("--ready-timeout", type=float, default=900.0, help="how long to wait for the server to start")
    so.add_argument("--out", default=None, help="result directory (default benchmarks/results)")
    so.add_argument("--tag", default=None, help="result files soak-<tag>-<stamp> (default <devices>-<model>)")
    so.set_defaults(func=_soak)

    sv = sub.add_parser("serve", help="online load test of any OpenAI-compatible server: streamed requests with "
                        "Poisson or burst arrivals; TTFT, TPOT, ITL, E2E, throughput, goodput; several servers compared")
    sv.add_argument("--url", action="append", default=None,
                    help="server base URL, e.g. http://127.0.0.1:8000 (repeatable: servers run one after another "
                         "with the same requests); required unless --start-server")
    sv.add_argument("--label", action="append", default=None,
                    help="a name per server, in the order of the servers (the started one first), e.g. minivllm, "
                         "llama-cpp-python (default: host-port; minivllm for --start-server)")
    sv.add_argument("--model", action="append", default=None,
                    help="the `model` field to send (default: the first id of GET /v1/models); one for all --url "
                         "targets or one per --url; with --start-server the first value is the model to serve")
    sv.add_argument("--api-key", default=None)
    sv.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    sv.add_argument("--num-prompts", type=int, default=200)
    sv.add_argument("--arrival", choices=["poisson", "burst"], default="poisson")
    sv.add_argument("--request-rate", type=float, default=float("inf"),
                    help="Poisson arrivals per second (default inf: all at once)")
    sv.add_argument("--burst-size", type=int, default=10, help="requests per burst (--arrival burst)")
    sv.add_argument("--burst-gap-s", type=float, default=1.0, help="seconds between bursts (--arrival burst)")
    sv.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    sv.add_argument("--input-len", type=int, default=128, help="prompt tokens (approximate without a tokenizer)")
    sv.add_argument("--output-len", type=int, default=128, help="max_tokens of every request")
    sv.add_argument("--input-len-range", type=_colon_range, default=None, metavar="A:B", help="uniform prompt length")
    sv.add_argument("--output-len-range", type=_colon_range, default=None, metavar="A:B", help="uniform max_tokens")
    sv.add_argument("--seed", type=int, default=0)
    sv.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                    help="send ignore_eos so output lengths match (default on)")
    sv.add_argument("--temperature", type=float, default=0.0)
    sv.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput SLO on TTFT")
    sv.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput SLO on TPOT")
    sv.add_argument("--warmup", type=int, default=1, help="unmeasured warm-up requests per server (default 1)")
    sv.add_argument("--tokenizer", default=None,
                    help="local model (name or .gguf) whose tokenizer sizes the prompts exactly "
                         "(default: the --start-server model; else lengths are approximate, by words)")
    sv.add_argument("--request-timeout", type=float, default=600.0, help="client timeout per request, seconds")
    sv.add_argument("--start-server", action="store_true",
                    help="start `python -m minivllm serve --model MODEL` here, load it, stop it")
    sv.add_argument("--inference-device", action="append", default=None,
                    help="with --start-server: serve's --inference-device (repeatable)")
    sv.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                    help="with --start-server: extra `minivllm serve` argument (repeatable; --serve-arg=--flag)")
    sv.add_argument("--start-peer", choices=["llama-cpp-python"], default=None,
                    help="with --start-server: then start llama-cpp-python's server on the same GGUF file and load "
                         "it with the same requests (`make peers` installs it from its sdist)")
    sv.add_argument("--peer-threads", type=int, default=None, help="--start-peer's CPU threads (default: all cores)")
    sv.add_argument("--peer-gpu-layers", type=int, default=0, help="--start-peer's n_gpu_layers (default 0: CPU)")
    sv.add_argument("--llama-cpp-path", default=None, help="site-packages holding llama-cpp-python, if not this env's")
    sv.add_argument("--ready-timeout", type=float, default=900.0, help="with --start-server: seconds to wait for /health")
    sv.add_argument("--out", default=None, help="result directory (default benchmarks/results)")
    sv.add_argument("--tag", default=None, help="result files serve-<label>-<tag>-<stamp>")
    sv.set_defaults(func=_serve_load)

    s = sub.add_parser("scheduling", help="scheduling policies: head-of-line TTFT and fairness between long prefills")
    _common(s)
    s.add_argument("--policies", type=lambda v: v.split(","), default=None,
                   help="comma list (default fcfs,shortest-prefill-first,round-robin)")
    s.add_argument("--long-prompts", type=int, default=3, help="head of line: long prompts before the short one")
    s.add_argument("--long-tokens", type=int, default=400)
    s.add_argument("--short-tokens", type=int, default=16)
    s.add_argument("--fair-prompts", type=int, default=4, help="fairness: long prompts submitted together")
    s.add_argument("--fair-tokens", type=int, default=400)
    s.add_argument("--max-batched-tokens", type=int, default=64, help="small, so prefills are chunked")
    s.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    s.add_argument("--page-size", type=int, default=16)
    s.add_argument("--max-repeats", type=int, default=None,
                   help="per workload, more rounds while a watched TTFT's CV exceeds 5%%, up to this "
                        "(default 3 x --repeats)")
    s.set_defaults(func=_scheduling)

    of = sub.add_parser("offline", help="offline throughput: N random-token requests (lengths uniform in ranges, EOS "
                        "ignored) submitted at once; output/total tok/s, requests/s, mean ± std over fresh engines")
    of.add_argument("--model", default="smollm2-135m")
    of.add_argument("--device", "--inference-device", dest="device", default="cpu", help="cpu, gpu, cuda:N")
    of.add_argument("--dtype", "--activation-dtype", dest="dtype", default="f32", help="f32, f16, bf16")
    of.add_argument("--num-seqs", type=int, default=256, help="requests (default 256)")
    of.add_argument("--input-len-range", type=_colon_range, default=(100, 1024), metavar="A:B",
                    help="prompt tokens, uniform in [A, B] (default 100:1024)")
    of.add_argument("--output-len-range", type=_colon_range, default=(100, 1024), metavar="A:B",
                    help="output tokens, uniform in [A, B], produced exactly (default 100:1024)")
    of.add_argument("--seed", type=int, default=0)
    of.add_argument("--runs", type=int, default=3, help="timed runs, each on a fresh engine (after one warm-up)")
    of.add_argument("--max-runs", type=int, default=8, help="more runs while the CV of output tok/s exceeds --cv-target")
    of.add_argument("--cv-target", type=float, default=0.05)
    of.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    of.add_argument("--max-seconds", type=float, default=None,
                    help="start no run that would end past this many seconds of timed runs (results are written "
                         "after every run)")
    of.add_argument("--no-warmup", action="store_true")
    of.add_argument("--quick", action="store_true", help="16 requests, lengths 32:128, 1 run + warm-up (CI, smoke)")
    of.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="engine option (repeatable), e.g. max_active_requests=64, max_batched_tokens=2048")
    of.set_defaults(func=_offline)

    pe = sub.add_parser("peers", help="CPU prefill and decode tok/s of minivllm vs transformers (and llama-cpp-python "
                        "when installed) on the same GGUF file and thread count; ratios vs minivllm")
    pe.add_argument("--model", default="smollm2-135m")
    pe.add_argument("--prompt-len", type=int, default=128, help="prompt tokens for the prefill measurement")
    pe.add_argument("--decode-tokens", type=int, default=64, help="greedy tokens decoded one at a time")
    pe.add_argument("--runs", type=int, default=3, help="timed runs per engine (after a warm-up)")
    pe.add_argument("--threads", type=int, default=None, help="threads for every engine (default: all cores)")
    pe.add_argument("--llama-cpp-path", default=None,
                    help="site-packages holding llama-cpp-python (default: $MINIVLLM_LLAMA_CPP_PATH, else the environment)")
    pe.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="engine option for minivllm (repeatable; default: the engine's kernel defaults)")
    pe.add_argument("--inference-device", default="cpu",
                    help="cpu (prefill/decode vs transformers and llama-cpp-python), or cuda:N / gpu: batched "
                         "generation vs transformers' own generate")
    pe.add_argument("--activation-dtype", default="f16", help="GPU only: f16 (default; T4 has no bf16), bf16, f32")
    pe.add_argument("--batch-sizes", default="1,8,32", help="GPU only: comma-separated batch sizes")
    pe.add_argument("--max-runs", type=int, default=8, help="at most this many runs while a CV exceeds 5%%")
    pe.set_defaults(func=_peers)

    pl = sub.add_parser("plot", help="draw the newest result file of each benchmark as a PNG figure "
                        "(benchmarks/plots/*.png and index.md; needs matplotlib: pip install 'minivllm[bench]')")
    pl.add_argument("--results", default=None, help="result directory to read (default benchmarks/results)")
    pl.add_argument("--out", default=None, help="figure directory to write (default benchmarks/plots)")
    pl.set_defaults(func=_plot)


def _common(p) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--inference-device", default="cpu", help="cpu, gpu, cuda:N")
    p.add_argument("--activation-dtype", default="f32", help="f32, f16, bf16")
    p.add_argument("--repeats", type=int, default=3)


def _options(items: list[str]) -> dict:
    from minivllm.engine.options import parse_overrides

    return parse_overrides(items, "option")


def _ints(v: str) -> list[int]:
    try:
        return [int(x) for x in v.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {v!r}") from None


def _gguf_open(args: argparse.Namespace) -> int:
    from minivllm.bench.gguf_open import run

    run(args.model or ["smollm2-135m", "qwen2.5-coder-0.5b"], repeats=args.repeats, baseline=args.baseline)
    return 0


def _names(v: str) -> list[str]:
    return [x.strip() for x in v.split(",") if x.strip()]


def _all(args: argparse.Namespace) -> int:
    from minivllm.bench.suite import run_suite

    devices = args.device
    if not devices:
        import torch

        devices = ["cuda:0"] if torch.cuda.is_available() else ["cpu"]
    try:
        return run_suite(devices, quick=args.quick, only=args.only, skip=args.skip, dry_run=args.dry_run,
                         timeout_s=args.timeout)
    except ValueError as exc:  # an unknown --only/--skip name
        raise SystemExit(f"minivllm bench all: {exc}") from None


def _decode(args: argparse.Namespace) -> int:
    from minivllm.bench.decode import run

    run(args.model, args.inference_device or ["cpu"], args.activation_dtype or ["f32"],
        max_tokens=args.max_tokens, prompt_tokens=args.prompt_tokens, repeats=args.repeats,
        max_repeats=args.max_repeats, threads=args.threads, baselines=not args.no_baselines, llama_cpp_path=args.llama_cpp_path, synthetic=args.synthetic,
        synthetic_tokenizer=args.synthetic_tokenizer, engine_options=_options(args.option), llama_bench=args.llama_bench)
    return 0


def _activation_dtype(args: argparse.Namespace) -> int:
    from minivllm.bench.activation_dtype import run

    rows = run(args.model, args.inference_device, args.activation_dtype, prompt_tokens=args.prompt_tokens,
               max_tokens=args.max_tokens, repeats=args.repeats, max_repeats=args.max_repeats, threads=args.threads)
    return 0 if all(r["status"] == "ok" for r in rows) else 1  # a dtype whose child process failed


def _gemv_threshold(args: argparse.Namespace) -> int:
    from minivllm.bench.gemv_threshold import run

    run(args.model, args.inference_device, args.activation_dtype, concurrency=args.concurrency,
        max_tokens=args.max_tokens, repeats=args.repeats, max_repeats=args.max_repeats,
        batch_invariant=args.batch_invariant)
    return 0


def _continuous_batching(args: argparse.Namespace) -> int:
    from minivllm.bench.continuous_batching import run

    run(args.model, args.inference_device, args.activation_dtype, concurrency=args.concurrency,
        max_tokens=args.max_tokens, decode_lengths=args.decode_lengths, quick=args.quick, repeats=args.repeats,
        max_repeats=args.max_repeats, max_batched_tokens=args.max_batched_tokens, page_size=args.page_size,
        parts=args.parts)
    return 0


def _scheduling(args: argparse.Namespace) -> int:
    from minivllm.bench.scheduling import run

    run(args.model, args.inference_device, args.activation_dtype, policies=args.policies, repeats=args.repeats,
        max_repeats=args.max_repeats, long_prompts=args.long_prompts, long_tokens=args.long_tokens,
        short_tokens=args.short_tokens, fair_prompts=args.fair_prompts, fair_tokens=args.fair_tokens, max_batched_tokens=args.max_batched_tokens,
        max_tokens=args.max_tokens, page_size=args.page_size)
    return 0


def _prefix_cache(args: argparse.Namespace) -> int:
    from minivllm.bench.prefix_cache import run

    run(args.model, args.inference_device, args.activation_dtype, repeats=args.repeats, max_repeats=args.max_repeats,
        output_tokens=args.output_tokens, parts=args.parts, groups=tuple(args.groups), page_size=args.page_size,
        max_batched_tokens=args.max_batched_tokens, max_active_requests=args.max_active_requests,
        synthetic=args.synthetic, synthetic_tokenizer=args.synthetic_tokenizer, engine_options=_options(args.option))
    return 0


def _speculative(args: argparse.Namespace) -> int:
    from minivllm.bench.speculative import run

    run(args.model, args.draft_model, args.inference_device, args.activation_dtype, max_tokens=args.max_tokens,
        runs=args.runs, max_runs=args.max_runs, seeds=args.seeds, parts=args.parts, prompts=args.prompts, cases=args.cases,
        sampling_policy=args.sampling_policy, tv_budgets=args.tv_budgets, temperature=args.temperature,
        engine_options=_options(args.option), synthetic_pair=args.synthetic_pair,
        synthetic_tokenizer=args.synthetic_tokenizer)
    return 0


def _routing(args: argparse.Namespace) -> int:
    from minivllm.bench.routing import run

    run(args.model, args.inference_device, args.dtype, bursts=args.bursts, policies=args.policies, runs=args.runs,
        max_runs=args.max_runs, max_tokens=args.max_tokens, prompt_tokens=args.prompt_tokens, prefix_tokens=args.prefix_tokens,
        arrival_ms=args.arrival_ms, max_active=args.max_active, fresh_per_run=args.fresh_per_run, quick=args.quick,
        engine_options=_options(args.option))
    return 0


def _range_parser(sep: str, cast, minimum):
    """An argparse type for "LO<sep>HI" with minimum <= LO <= HI (burst sizes, gaps, lengths)."""
    kind = "integers" if cast is int else "numbers"

    def parse(v: str):
        try:
            lo, hi = (cast(x) for x in v.split(sep))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected MIN{sep}MAX {kind}, got {v!r}") from None
        if not minimum <= lo <= hi:
            raise argparse.ArgumentTypeError(f"expected {minimum} <= MIN <= MAX, got {v!r}")
        return lo, hi
    return parse


_int_range, _float_range, _colon_range = _range_parser(",", int, 1), _range_parser(",", float, 0), _range_parser(":", int, 1)


def _soak(args: argparse.Namespace) -> int:
    from minivllm.reliability.soak import SoakSettings, run

    settings = SoakSettings(requests=args.requests, seed=args.seed, cancel_fraction=args.cancel_fraction,
                            disconnect_fraction=args.disconnect_fraction, max_new_tokens=args.max_new_tokens,
                            min_prompt_tokens=args.min_prompt_tokens, max_prompt_tokens=args.max_prompt_tokens,
                            stream_fraction=args.stream_fraction, chat_fraction=args.chat_fraction, burst=args.burst,
                            gap_s=args.gap, trickle_rate=args.trickle_rate, drain_to=args.drain_to,
                            max_duration_s=args.max_duration, request_timeout_s=args.request_timeout, idle_timeout_s=args.idle_timeout,
                            max_rss_growth=args.max_rss_growth or None)
    result = run(args.model, args.inference_device, url=args.url, settings=settings, max_model_len=args.max_model_len,
                 page_size=args.page_size, max_active_requests=args.max_active_requests, router=args.router,
                 api_key=args.api_key, serve_args=args.serve_arg, out_dir=args.out, tag=args.tag,
                 ready_timeout_s=args.ready_timeout)
    return 0 if result["ok"] else 1


def _serve_load(args: argparse.Namespace) -> int:
    from minivllm.bench.serve_load import LoadSettings, run

    if not args.url and not args.start_server:
        raise SystemExit("minivllm bench serve: give --url URL (repeatable) or --start-server --model MODEL")
    models = list(args.model or [])
    start_model = None
    if args.start_server:
        start_model = models.pop(0) if models else "smollm2-135m"
    try:
        settings = LoadSettings(
            endpoint=args.endpoint, num_prompts=args.num_prompts, arrival=args.arrival, request_rate=args.request_rate,
            burst_size=args.burst_size, burst_gap_s=args.burst_gap_s, max_concurrency=args.max_concurrency,
            input_len=args.input_len, output_len=args.output_len, input_len_range=args.input_len_range,
            output_len_range=args.output_len_range, seed=args.seed, ignore_eos=args.ignore_eos,
            temperature=args.temperature, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
            request_timeout_s=args.request_timeout)
        result = run(args.url, args.label, settings, models=models, api_key=args.api_key, start_server=start_model,
                     inference_devices=args.inference_device, serve_args=args.serve_arg, tokenizer=args.tokenizer,
                     warmup=args.warmup, out_dir=args.out, tag=args.tag, ready_timeout_s=args.ready_timeout,
                     start_peer=args.start_peer, peer_threads=args.peer_threads,
                     peer_gpu_layers=args.peer_gpu_layers, llama_cpp_path=args.llama_cpp_path)
    except (ValueError, RuntimeError) as exc:  # bad settings; a server that fails its warm-up or start-up
        msg = str(exc)
        raise SystemExit(msg if msg.startswith("bench serve") else f"bench serve: {msg}") from None
    return 0 if all(t["summary"]["completed"] > 0 for t in result["targets"]) else 1


def _shapes(v: str) -> list[tuple[int, int]]:
    try:
        return [tuple(int(d) for d in s.lower().split("x")) for s in v.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of NxK such as 3584x3584, got {v!r}") from None


def _kernels(args: argparse.Namespace) -> int:
    import torch

    from minivllm.bench.kernels import run
    from minivllm.devices import resolve_device

    if not torch.cuda.is_available():
        print("minivllm bench kernels: needs a CUDA device (it times the Triton GEMV kernels); torch sees none here.")
        return 2
    run(args.types, args.shapes, device=str(resolve_device(args.inference_device)), batch_rows=args.batch_rows)
    return 0


def _offline(args: argparse.Namespace) -> int:
    from minivllm.bench.offline import run

    run(args.model, args.device, args.dtype, num_seqs=args.num_seqs, input_len_range=args.input_len_range,
        output_len_range=args.output_len_range, seed=args.seed, runs=args.runs, max_runs=args.max_runs,
        cv_target=args.cv_target, quick=args.quick, threads=args.threads, engine_options=_options(args.option),
        warmup=not args.no_warmup, max_seconds=args.max_seconds)
    return 0


def _plot(args: argparse.Namespace) -> int:
    import sys

    from minivllm.bench.plots import DEFAULT_OUT, MatplotlibMissing, plot_all

    # Not results.RESULTS_DIR: that module imports torch, which drawing does not need.
    results = args.results or "benchmarks/results"
    try:
        plot_all(results, args.out or DEFAULT_OUT)
    except MatplotlibMissing as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


def _peers(args: argparse.Namespace) -> int:
    if args.inference_device != "cpu":
        from minivllm.bench.peers_gpu import run as run_gpu

        sizes = tuple(int(x) for x in args.batch_sizes.split(",") if x.strip())
        run_gpu(args.model, args.inference_device, args.activation_dtype, batch_sizes=sizes,
                prompt_len=args.prompt_len, decode_tokens=args.decode_tokens, runs=args.runs,
                max_runs=args.max_runs, engine_options=_options(args.option))
        return 0
    from minivllm.bench.peers import run

    run(args.model, prompt_len=args.prompt_len, decode_tokens=args.decode_tokens, runs=args.runs,
        threads=args.threads, llama_cpp_path=args.llama_cpp_path, engine_options=_options(args.option),
        max_runs=args.max_runs)
    return 0
