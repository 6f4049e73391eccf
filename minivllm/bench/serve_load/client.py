"""The streaming HTTP client: one request's SSE exchange, the seeded schedule of a whole run, a probe."""

from __future__ import annotations

import asyncio
import json
import time

from minivllm.bench.serve_load.metrics import RequestResult
from minivllm.bench.serve_load.workload import WARMUP_PROMPT, LoadSettings, RequestSpec, request_body


def endpoint_path(endpoint: str) -> str:
    return "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"


async def stream_request(client, path: str, body: dict, rec: RequestResult, clock) -> None:
    """POST one streamed request and fill `rec` (send time, content chunk times, end, usage, outcome)."""
    import httpx

    rec.send_s = clock()
    try:
        async with client.stream("POST", path, json=body) as r:
            rec.status = r.status_code
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                rec.fail(f"HTTP {r.status_code}: {text[:300]}", clock())
                return
            usage = None
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, ": ping" comments, "event:" lines
                payload = line[5:].strip()
                if payload == "[DONE]":
                    rec.got_done = True
                    break
                t = clock()
                try:
                    obj = json.loads(payload)
                except ValueError:
                    rec.fail(f"bad JSON chunk: {payload[:200]!r}", t)
                    return
                if not isinstance(obj, dict):
                    rec.fail(f"not a JSON object: {payload[:200]!r}", t)
                    return
                if obj.get("error"):
                    err = obj["error"]
                    rec.fail("error chunk: " + (err.get("message") if isinstance(err, dict) else str(err))[:300], t)
                    return
                choices = obj.get("choices") or []
                if choices:
                    rec.chunk_s.append(t)
                    c = choices[0] if isinstance(choices[0], dict) else {}
                    text = c.get("text")
                    if text is None:
                        text = (c.get("delta") or {}).get("content")
                    rec.text_chars += len(text or "")
                    # Some servers (llama-cpp-python) end with a chunk holding only the finish
                    # reason: not a token when counting tokens without usage.
                    if text or not c.get("finish_reason"):
                        rec.token_chunks += 1
                    if c.get("finish_reason"):
                        rec.finish_reason = c["finish_reason"]
                if obj.get("usage"):
                    usage = obj["usage"]
            end = clock()
    except httpx.HTTPError as exc:
        rec.fail(f"{type(exc).__name__}: {exc}"[:300], clock())
        return
    except Exception as exc:  # noqa: BLE001 - an odd chunk shape fails this request, not the run
        rec.fail(f"client error: {exc!r}"[:300], clock())
        return
    if not rec.chunk_s:
        rec.fail("the stream carried no content chunk", end)
    elif not rec.got_done and rec.finish_reason is None:
        rec.fail(f"the stream ended without [DONE] or a finish_reason after {len(rec.chunk_s)} chunks", end)
    else:
        rec.ok, rec.end_s = True, end
        if usage and usage.get("completion_tokens") is not None:
            rec.output_tokens, rec.tokens_from = int(usage["completion_tokens"]), "usage"
        else:
            rec.output_tokens, rec.tokens_from = rec.token_chunks, "chunks"
        if usage and usage.get("prompt_tokens") is not None:
            rec.prompt_tokens = int(usage["prompt_tokens"])


def _headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _client(url: str, api_key: str | None, timeout_s: float):
    import httpx

    return httpx.AsyncClient(base_url=url, headers=_headers(api_key), timeout=httpx.Timeout(timeout_s, connect=60.0),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))


async def drive(url: str, specs: list[RequestSpec], settings: LoadSettings, *, model: str | None,
                api_key: str | None = None, warmup: int = 1, progress: bool = True,
                label: str = "") -> tuple[list[RequestResult], float]:
    """Send the requests at their arrival times (at most max_concurrency in flight); returns
    the results and the duration (first arrival to the end of the last request)."""
    path = endpoint_path(settings.endpoint)
    sem = asyncio.Semaphore(settings.max_concurrency) if settings.max_concurrency else None
    results = [RequestResult(s.index, s.input_len, s.output_len) for s in specs]
    async with _client(url, api_key, settings.request_timeout_s) as client:
        for i in range(warmup):
            rec = RequestResult(-1 - i, 0, 4)
            await stream_request(client, path, request_body(WARMUP_PROMPT, 4, settings, model), rec, time.perf_counter)
            if not rec.ok:
                raise RuntimeError(f"bench serve: the warm-up request to {url}{path} failed: {rec.error}")
        t0 = time.perf_counter()
        clock = lambda: time.perf_counter() - t0  # noqa: E731
        done = 0
        step = max(1, len(specs) // 10)

        async def one(spec: RequestSpec, rec: RequestResult) -> None:
            nonlocal done
            body = request_body(spec.prompt, spec.output_len, settings, model)
            if sem is None:
                await stream_request(client, path, body, rec, clock)
            else:
                async with sem:
                    await stream_request(client, path, body, rec, clock)
            done += 1
            if progress and (done % step == 0 or done == len(specs)):
                failed = sum(1 for r in results if r.end_s is not None and not r.ok)
                print(f"bench serve{' ' + label if label else ''}: {done}/{len(specs)} done after {clock():.1f} s"
                      + (f" ({failed} failed)" if failed else ""), flush=True)

        tasks = []
        for spec, rec in zip(specs, results):
            delay = spec.arrival_s - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(spec, rec)))
        await asyncio.gather(*tasks)
        duration = clock()
    return results, duration


def probe(url: str, api_key: str | None) -> dict:
    """GET /v1/models (required) and /health (optional) of the server."""
    import httpx

    try:
        r = httpx.get(url + "/v1/models", headers=_headers(api_key), timeout=30)
        r.raise_for_status()
        models = r.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise RuntimeError(f"bench serve: GET {url}/v1/models failed: {type(exc).__name__}: {exc}") from exc
    health = None
    try:
        h = httpx.get(url + "/health", headers=_headers(api_key), timeout=10)
        if h.status_code == 200:
            health = h.json() if "json" in h.headers.get("content-type", "") else h.text[:500]
    except (httpx.HTTPError, ValueError):
        pass
    return {"v1_models": models, "health": health}
