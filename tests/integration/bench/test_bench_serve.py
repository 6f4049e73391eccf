"""`minivllm bench serve`: the load generator's metric math on hand-made timestamps, its SSE
client against canned streams, and a real run against an in-process `minivllm serve`
(SmolLM2-135M, one cpu:1 worker): 12 streamed requests, Poisson 4/s, concurrency 4, 8
output tokens each (ignore_eos), twice (two labels, so the comparison table is written too).
Every reported statistic is recomputed here with numpy from the per-request values.
"""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import numpy as np
import pytest

from minivllm.bench.serve_load import (
    LoadSettings,
    RequestResult,
    arrival_offsets,
    make_requests,
    request_metrics,
    stream_request,
    summarize,
)
from minivllm.cli.main import build_parser

pytestmark = pytest.mark.timeout(300)

N_PROMPTS, RATE, CONCURRENCY, INPUT_LEN, OUTPUT_LEN = 12, 4.0, 4, 32, 8
PROVENANCE_KEYS = {"commit", "date", "device", "host", "python", "torch", "gguf", "tokenizers", "settings"}


# -- metric math, no server -----------------------------------------------------------------------


def test_request_metrics_by_hand():
    m = request_metrics(send_s=1.0, chunk_s=[1.5, 1.625, 1.875, 2.25], end_s=2.5, output_tokens=4)
    assert m["ttft_s"] == 0.5
    assert m["e2e_s"] == 1.5
    assert m["itl_s"] == [0.125, 0.25, 0.375]
    assert m["tpot_s"] == (1.5 - 0.5) / 3
    one = request_metrics(send_s=0.0, chunk_s=[0.25], end_s=0.5, output_tokens=1)
    assert one["tpot_s"] is None and one["itl_s"] == [] and one["ttft_s"] == 0.25
    with pytest.raises(ValueError):
        request_metrics(0.0, [], 1.0, 0)


def _done(index, send, chunks, end, tokens, prompt=10):
    return RequestResult(index, prompt, tokens, ok=True, send_s=send, chunk_s=chunks, end_s=end, prompt_tokens=prompt,
                         output_tokens=tokens, tokens_from="usage")


def test_summarize_by_hand():
    results = [
        _done(0, 0.0, [0.5, 0.75, 1.0], 1.0, 3),  # ttft 0.5, tpot 0.25, itl .25 .25
        _done(1, 0.5, [0.75, 1.75], 2.0, 2),  # ttft 0.25, tpot 1.25, itl 1.0
        _done(2, 1.0, [3.0], 3.0, 1),  # ttft 2.0, no tpot
        RequestResult(3, 10, 3, ok=False, error="HTTP 429: busy", send_s=1.5, end_s=1.5),
    ]
    s = summarize(results, duration_s=4.0, slo_ttft_ms=600, slo_tpot_ms=300)
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["total_output_tokens"] == 6 and s["total_input_tokens"] == 30
    assert s["request_throughput"] == 3 / 4.0
    assert s["output_throughput"] == 6 / 4.0
    assert s["total_token_throughput"] == 36 / 4.0
    # Request 0 meets both SLOs; 1 misses TPOT (1250 ms); 2 misses TTFT (2000 ms).
    assert s["good_requests"] == 1 and s["goodput"] == 1 / 4.0
    assert summarize(results, 4.0, slo_ttft_ms=math.inf, slo_tpot_ms=math.inf)["goodput"] == s["request_throughput"]
    assert summarize(results, 4.0, slo_ttft_ms=0.0)["goodput"] == 0.0
    assert summarize(results, 4.0)["goodput"] is None
    ttft = np.array([500.0, 250.0, 2000.0])
    assert s["ttft_ms"]["mean"] == pytest.approx(ttft.mean())
    assert s["ttft_ms"]["median"] == pytest.approx(500.0)
    assert s["ttft_ms"]["p99"] == pytest.approx(np.percentile(ttft, 99))
    assert s["ttft_ms"]["std"] == pytest.approx(np.std(ttft))
    assert s["tpot_ms"]["n"] == 2 and s["tpot_ms"]["mean"] == pytest.approx((250.0 + 1250.0) / 2)
    assert s["itl_ms"]["n"] == 3 and s["itl_ms"]["median"] == pytest.approx(250.0)
    assert s["e2e_ms"]["max"] == pytest.approx(2000.0)
    assert s["errors"] == [{"error": "HTTP 429: busy", "count": 1}]
    assert s["peak_in_flight"] == 2  # an end and a start at the same instant do not overlap
    assert s["output_len_mismatch"] == 0


def test_arrivals_and_requests_are_seeded():
    burst = LoadSettings(num_prompts=7, arrival="burst", burst_size=3, burst_gap_s=2.0)
    assert arrival_offsets(burst) == [0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 4.0]
    assert arrival_offsets(LoadSettings(num_prompts=4)) == [0.0] * 4  # rate inf: all at once
    poisson = LoadSettings(num_prompts=2000, request_rate=5.0, seed=7)
    t = arrival_offsets(poisson)
    assert t[0] == 0.0 and all(b >= a for a, b in zip(t, t[1:]))
    assert np.mean(np.diff(t)) == pytest.approx(1 / 5.0, rel=0.1)
    assert t == arrival_offsets(LoadSettings(num_prompts=2000, request_rate=5.0, seed=7))
    s = LoadSettings(num_prompts=20, input_len_range=(4, 40), output_len_range=(2, 9), seed=3)
    a, b = make_requests(s), make_requests(s)
    assert [(x.prompt, x.input_len, x.output_len) for x in a] == [(x.prompt, x.input_len, x.output_len) for x in b]
    assert all(4 <= x.input_len <= 40 and 2 <= x.output_len <= 9 for x in a)
    assert len({x.prompt for x in a}) == 20
    assert make_requests(LoadSettings(num_prompts=3, seed=4))[0].prompt != a[0].prompt


def test_cli_parses_serve_options():
    args = build_parser().parse_args(["bench", "serve", "--url", "http://a:1", "--label", "x", "--url", "http://b:2",
                                      "--label", "y", "--prompt-tokens-range", "4:8", "--no-ignore-eos",
                                      "--request-rate", "inf", "--slo-ttft-ms", "200"])
    assert args.url == ["http://a:1", "http://b:2"] and args.label == ["x", "y"]
    assert args.prompt_tokens_range == (4, 8) and args.ignore_eos is False and math.isinf(args.request_rate)
    assert args.endpoint == "completions" and args.num_prompts == 200 and args.arrival == "poisson"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "serve", "--url", "u", "--max-tokens-range", "9:2"])


# -- the SSE client against canned answers --------------------------------------------------------


def _sse(*events) -> bytes:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events).encode()


def _exchange(status: int, content: bytes) -> RequestResult:
    async def handler(request):
        body = json.loads(await request.aread())
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        return httpx.Response(status, content=content, headers={"content-type": "text/event-stream"})

    async def go():
        ticks = iter(range(100))
        rec = RequestResult(0, 5, 3)
        async with httpx.AsyncClient(base_url="http://test", transport=httpx.MockTransport(handler)) as client:
            await stream_request(
                client,
                "/v1/chat/completions",
                {"stream": True, "stream_options": {"include_usage": True}},
                rec,
                lambda: float(next(ticks)),
            )
        return rec

    return asyncio.run(go())


def test_stream_client_records_chunks_usage_and_failures():
    chunk = lambda delta, fin=None: {"choices": [{"index": 0, "delta": delta, "finish_reason": fin}]}  # noqa: E731
    ok = _exchange(200, b": ping\n\n" + _sse(chunk({"role": "assistant", "content": ""}), chunk({"content": "Hi"}),
                                             chunk({"content": "!"}, "length"),
                                             {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}},
                                             "[DONE]"))
    assert ok.ok and ok.error is None and ok.finish_reason == "length" and ok.got_done
    assert ok.send_s == 0.0 and ok.chunk_s == [1.0, 2.0, 3.0]  # the usage chunk is not a content chunk
    assert ok.end_s == 5.0 and ok.output_tokens == 3 and ok.tokens_from == "usage" and ok.prompt_tokens == 5
    no_usage = _exchange(200, _sse(chunk({"content": "a"}), chunk({"content": "b"}, "stop"), "[DONE]"))
    assert no_usage.ok and no_usage.output_tokens == 2 and no_usage.tokens_from == "chunks"
    assert no_usage.prompt_tokens is None

    busy = _exchange(429, b'{"error": {"message": "too many requests"}}')
    assert not busy.ok and busy.status == 429 and "too many requests" in busy.error
    err = _exchange(200, _sse(chunk({"content": "a"}), {"error": {"message": "worker died"}}))
    assert not err.ok and "worker died" in err.error
    cut = _exchange(200, _sse(chunk({"content": "a"})))
    assert not cut.ok and "without [DONE]" in cut.error
    empty = _exchange(200, _sse("[DONE]"))
    assert not empty.ok and "no content chunk" in empty.error
    odd = _exchange(200, _sse({"choices": [{"delta": "not an object"}]}, "[DONE]"))
    assert not odd.ok and odd.error.startswith("client error")  # fails the request, not the run
    s = summarize([ok, no_usage, busy, err, cut, empty, odd], 10.0)
    assert (s["completed"], s["failed"]) == (2, 5)
    assert s["output_tokens_from"] == "content chunks (approximate)"
    assert s["input_tokens_from"] == "requested lengths (approximate)"


# -- a real minivllm server -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(smollm2_path, tmp_path_factory):
    from minivllm.bench.serve_load import run
    from minivllm.serving import Cluster
    from minivllm.serving.http_server import start_server_in_background

    cluster = Cluster(str(smollm2_path), ["cpu:1"], max_model_len=256).start()
    srv = start_server_in_background(cluster)
    out = tmp_path_factory.mktemp("bench-serve")
    settings = LoadSettings(num_prompts=N_PROMPTS, request_rate=RATE, max_concurrency=CONCURRENCY, input_len=INPUT_LEN,
                            output_len=OUTPUT_LEN, ignore_eos=True, seed=5, slo_ttft_ms=math.inf, slo_tpot_ms=math.inf,
                            request_timeout_s=120.0)
    try:
        result = run([srv.url, srv.url], ["minivllm", "minivllm-again"], settings, tokenizer=str(smollm2_path),
                     out_dir=out, tag="ci", progress=False)
    finally:
        srv.stop()
        cluster.stop()
    return result, out, settings, cluster.model_name


def _records(target) -> list[RequestResult]:
    return [RequestResult(r["index"], r["input_len"], r["output_len"], ok=r["ok"], error=r["error"], send_s=r["send_s"],
                          chunk_s=r["chunk_s"], end_s=r["end_s"], prompt_tokens=r["prompt_tokens"],
                          output_tokens=r["output_tokens"], tokens_from=r["tokens_from"])
            for r in target["requests"]]


def test_every_request_succeeds_with_exact_lengths(served):
    result, _, _, _ = served
    for t in result["targets"]:
        rows = t["requests"]
        assert len(rows) == N_PROMPTS
        assert all(r["ok"] for r in rows), [r["error"] for r in rows if not r["ok"]]
        assert [r["output_tokens"] for r in rows] == [OUTPUT_LEN] * N_PROMPTS
        assert {r["tokens_from"] for r in rows} == {"usage"}
        assert {r["finish_reason"] for r in rows} == {"length"}
        # Prompts cut to 32 tokens with the model's own tokenizer (the server may add a BOS).
        assert all(INPUT_LEN <= r["prompt_tokens"] <= INPUT_LEN + 2 for r in rows), [r["prompt_tokens"] for r in rows]
        s = t["summary"]
        assert (s["completed"], s["failed"], s["errors"]) == (N_PROMPTS, 0, [])
        assert s["total_output_tokens"] == N_PROMPTS * OUTPUT_LEN and s["output_len_mismatch"] == 0
        assert s["total_input_tokens"] == sum(r["prompt_tokens"] for r in rows) and s["input_tokens_from"] == "usage"
        assert s["peak_in_flight"] <= CONCURRENCY
    # Both servers got the same seeded requests.
    a, b = (t["requests"] for t in result["targets"])
    assert [r["prompt_tokens"] for r in a] == [r["prompt_tokens"] for r in b]


def test_per_request_metrics_are_consistent(served):
    result, _, settings, _ = served
    arrivals = arrival_offsets(settings)
    for t in result["targets"]:
        for r in t["requests"]:
            assert 0 < r["ttft_s"] < r["e2e_s"]
            assert r["ttft_s"] == pytest.approx(r["chunk_s"][0] - r["send_s"], abs=1e-12)
            assert r["e2e_s"] == pytest.approx(r["end_s"] - r["send_s"], abs=1e-12)
            assert abs(r["tpot_s"] * (r["output_tokens"] - 1) + r["ttft_s"] - r["e2e_s"]) < 1e-6
            assert r["send_s"] >= arrivals[r["index"]] - 1e-3  # nothing is sent before it arrives
            assert r["chunk_s"] == sorted(r["chunk_s"]) and r["end_s"] >= r["chunk_s"][-1]


def test_reported_statistics_match_numpy(served):
    result, _, _, _ = served
    for t in result["targets"]:
        rows, s = t["requests"], t["summary"]
        per = {"ttft_ms": np.array([r["ttft_s"] for r in rows]) * 1000,
               "e2e_ms": np.array([r["e2e_s"] for r in rows]) * 1000,
               "tpot_ms": np.array([r["tpot_s"] for r in rows]) * 1000,
               "itl_ms": np.concatenate([np.diff(r["chunk_s"]) for r in rows]) * 1000}
        assert len(per["itl_ms"]) > 0
        for key, values in per.items():
            st = s[key]
            assert st["n"] == len(values), key
            assert st["mean"] == pytest.approx(np.mean(values), rel=1e-9, abs=1e-9), key
            assert st["median"] == pytest.approx(np.median(values), rel=1e-9, abs=1e-9), key
            assert st["p90"] == pytest.approx(np.percentile(values, 90), rel=1e-9, abs=1e-9), key
            assert st["p99"] == pytest.approx(np.percentile(values, 99), rel=1e-9, abs=1e-9), key
            assert st["std"] == pytest.approx(np.std(values), rel=1e-9, abs=1e-9), key
        duration = s["duration_s"]
        assert duration >= max(r["end_s"] for r in rows) - 1e-9
        assert s["output_throughput"] == pytest.approx(s["total_output_tokens"] / duration, rel=1e-12)
        assert s["request_throughput"] == pytest.approx(N_PROMPTS / duration, rel=1e-12)
        assert s["total_token_throughput"] == pytest.approx(
            (s["total_input_tokens"] + s["total_output_tokens"]) / duration, rel=1e-12)
        # Goodput: SLOs of infinity pass everything, SLOs of 0 ms nothing.
        assert s["goodput"] == pytest.approx(s["request_throughput"], rel=1e-12) and s["good_requests"] == N_PROMPTS
        records = _records(t)
        assert summarize(records, duration, slo_ttft_ms=0.0)["goodput"] == 0.0
        assert summarize(records, duration, slo_tpot_ms=0.0)["goodput"] == 0.0
        assert summarize(records, duration, slo_ttft_ms=0.0, slo_tpot_ms=0.0)["good_requests"] == 0
        again = summarize(records, duration, math.inf, math.inf)
        assert again["ttft_ms"] == s["ttft_ms"] and again["itl_ms"] == s["itl_ms"]


def test_result_files_with_provenance(served):
    result, out, _, model_name = served
    files = sorted(out.iterdir())
    names = [f.name for f in files]
    assert len(files) == 6, names  # two targets and the comparison, .json and .md each
    assert result["files"] and all(str(f) in result["files"] for f in files)
    for t in result["targets"]:
        data = json.loads(
            (out / [n for n in names if n.startswith(f"serve-{t['label']}-ci-") and n.endswith(".json")][0]).read_text()
        )
        assert data["benchmark"] == "serve" and data["label"] == t["label"]
        assert PROVENANCE_KEYS <= set(data["provenance"])
        cfg = data["provenance"]["settings"]
        assert (cfg["num_prompts"], cfg["request_rate"], cfg["max_concurrency"], cfg["output_len"]) == (
            N_PROMPTS, RATE, CONCURRENCY, OUTPUT_LEN)
        assert cfg["ignore_eos"] is True and cfg["slo_ttft_ms"] == "inf" and cfg["prompt_sizing"] == "exact (tokenizer)"
        assert data["target"]["url"].startswith("http://127.0.0.1:")
        assert [m["id"] for m in data["target"]["v1_models"]["data"]] == [model_name]
        assert data["target"]["model"] == model_name
        assert data["target"]["health"]["status"] == "ok"
        assert data["summary"] == t["summary"] and len(data["requests"]) == N_PROMPTS
        md_files = [n for n in names if n.startswith(f"serve-{t['label']}-ci-") and n.endswith(".md")]
        text = (out / md_files[0]).read_text()
        assert "| TTFT median (ms) |" in text and "| output token throughput (tok/s) |" in text
        assert "| goodput (req/s) |" in text and '"commit"' in text
    compare = [n for n in names if n.startswith("serve-compare-minivllm-vs-minivllm-again-ci-")]
    assert sorted(n.rsplit(".", 1)[1] for n in compare) == ["json", "md"]
    md = next(out / n for n in compare if n.endswith(".md")).read_text()
    header = next(line for line in md.splitlines() if line.startswith("| metric |"))
    assert header == "| metric | minivllm | minivllm-again | minivllm-again / minivllm |"
    row = next(line for line in md.splitlines() if line.startswith("| successful requests |"))
    assert row == f"| successful requests | {N_PROMPTS} | {N_PROMPTS} | 1.000 |"
    assert md.count("| TPOT p99 (ms) |") == 1
    data = json.loads(next(out / n for n in compare if n.endswith(".json")).read_text())
    assert data["labels"] == ["minivllm", "minivllm-again"] and PROVENANCE_KEYS <= set(data["provenance"])
    assert result["table"] in md
