"""The OpenAI-compatible HTTP API over a `Cluster` (FastAPI).

    GET  /health                 worker states; 503 when no worker is up (never needs a key)
    GET  /v1/models              the served model
    POST /v1/completions         text completion, JSON or SSE stream
    POST /v1/chat/completions    chat completion through the model's own chat template
    GET  /v1/cluster/snapshot    every worker's engine snapshot, the router's decisions and the
                                 request ledger (?fresh=true asks the workers for new snapshots)
    POST /v1/cluster/workers/{name}/restart   replace one worker; the others keep serving
    GET  /metrics                Prometheus text format

Every route but /health needs the API key when one is set; without one, only loopback or
allowed Host names and no cross-site browser requests get in (`http_origin.py`, a 403 or
415), and the snapshot hides file paths. Bodies over the size limit get
a 413 and generation requests over the concurrency limit a 429 (`http_guards.py`), as do
requests no worker has room for under its queued-prompt-token limit (`Cluster._admissible`).
Connections are guarded below the app (`http_connections.py`): a header-read timeout and
a cap on open connections. Work run off the event loop goes through `off_loop.py`, so any
exception there (StopIteration included) is a 500 that gives back its slot.

Streams follow OpenAI's SSE format: one `data: {chunk}` per token event, a last chunk
with finish_reason, an optional usage chunk (stream_options.include_usage), then
`data: [DONE]`. Chat requests with tools get `message.tool_calls` (finish_reason
"tool_calls") when the output holds calls (tool_calls.py, tool_call_parser.py); streamed,
content goes out until a call may start and each call comes whole in one `delta.tool_calls`
chunk at the end. A constraint (response_format, guided_*, a forced tool call) that the
engine finds it cannot complete is a 400 naming its field. Every response carries a
`minivllm` extension object with the request's timing (TTFT, prefill and decode tok/s, the
worker, tokens restored from the prefix cache). A client that disconnects, streaming or
not, cancels its request, which frees its KV pages.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minivllm.errors import ConfigError, MinivllmError
from minivllm.sampling.constraint_limits import MAX_JSON_DEPTH
from minivllm.serving.cluster import AdmissionRefused
from minivllm.serving.http_guards import ApiKeyGuard, BodySizeLimit, ConcurrencyLimit, ServerLimits, error_body
from minivllm.serving.http_origin import LocalOnlyGuard
from minivllm.serving.metrics import ServingMetrics
from minivllm.serving.off_loop import in_thread, thread_future
from minivllm.serving.openai_schema import ChatCompletionRequest, CompletionRequest
from minivllm.serving.request_stream import RequestStream
from minivllm.serving.router import NoWorkerAvailable
from minivllm.serving.tool_call_parser import ToolCallStream, reply_calls
from minivllm.serving.tool_calls import ToolRequest

CHAT_DEFAULT_MAX_TOKENS = 256
CONSTRAINT_FAILED = "the structured output ("  # how the engine's error for an unsatisfiable constraint begins
COMPLETION_DEFAULT_MAX_TOKENS = 16
HIDDEN = "<hidden path>"  # what unauthenticated clients see of a file path

logger = logging.getLogger("minivllm.http")


def error_response(status: int, message: str, kind: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    return Response(error_body(message, kind, param), status_code=status, media_type="application/json",
                    headers=headers)


def without_file_paths(value, directories: list[str]):
    """A snapshot for clients without a key: every `*_path` value and every mention of
    the model files' directories hidden (a web page must not learn where they live)."""
    if isinstance(value, dict):
        return {k: (HIDDEN if isinstance(k, str) and k.endswith("_path") and v is not None
                    else without_file_paths(v, directories)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [without_file_paths(v, directories) for v in value]
    if isinstance(value, str):
        for d in directories:
            value = value.replace(d, HIDDEN)
    return value


def timing_extension(stream: RequestStream) -> dict:
    m = stream.metrics or {}
    return {"worker": stream.worker, "route_reason": (stream.decision or {}).get("reason"),
            "ttft_s": m.get("time_to_first_token_s"), "queue_time_s": m.get("queue_time_s"), "e2e_s": m.get("e2e_s"),
            "prefill_tokens_per_s": m.get("prefill_tokens_per_s"), "decode_tokens_per_s": m.get("decode_tokens_per_s"),
            "restored_tokens": m.get("cached_prompt_tokens"), "preemptions": m.get("preemptions"),
            "speculation": m.get("speculation"), "split": m.get("split")}


def usage(stream: RequestStream) -> dict:
    prompt, completion = len(stream.prompt_token_ids), len(stream.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def create_app(cluster, *, api_key: str | None = None, served_model_name: str | None = None,
               limits: ServerLimits | None = None, allowed_hosts: tuple[str, ...] = ()) -> FastAPI:
    """`allowed_hosts`: without `api_key`, the Host names besides loopback that may call
    (`http_origin.py`); with a key they are not needed."""
    limits = limits or ServerLimits()
    app = FastAPI(title="minivllm", version="0.1.0",
                  description="OpenAI-compatible API over minivllm's device workers and router.")
    model_name = served_model_name or cluster.model_name
    metrics = ServingMetrics(cluster)
    app.state.cluster, app.state.metrics, app.state.limits = cluster, metrics, limits
    created = int(time.time())
    reject = lambda reason: metrics.rejected.labels(reason).inc()  # noqa: E731
    # Added innermost first: the key is checked before a body is read, the body's size
    # before it is parsed, and only then does a request take a generation slot.
    app.add_middleware(ConcurrencyLimit, limit=limits.max_concurrent_requests, on_reject=reject)
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_request_bytes, on_reject=reject,
                       timeout_s=limits.header_timeout_s)
    app.add_middleware(ApiKeyGuard, api_key=api_key, on_reject=reject)
    if api_key is None:
        app.add_middleware(LocalOnlyGuard, allowed_hosts=tuple(allowed_hosts), on_reject=reject)
    model_dirs = sorted({str(Path(p).parent) for p in (cluster.model_path, getattr(cluster, "draft_model_path", None))
                         if p is not None}, key=len, reverse=True)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        # A bug, not the client's fault: a 500 in the API shape (the traceback goes to the
        # log), and the middlewares' finally blocks still give back what the request held.
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(500, f"internal error ({type(exc).__name__}: {exc}); the server's log has the "
                                   "traceback", "server_error")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        # FastAPI's own refusals (a body that is not JSON or not UTF-8, an unknown route,
        # a wrong method) in the same error shape as ours.
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 400 and "parsing the body" in detail and isinstance(exc.__cause__, RecursionError):
            # Valid JSON that nests deeper than Python's parser can follow (~900 levels).
            detail = (f"the request body nests JSON deeper than the parser can follow; schemas, grammars' %json, "
                      f"tools and tool-call arguments may nest at most {MAX_JSON_DEPTH} levels of objects and arrays")
        elif exc.status_code == 400 and "parsing the body" in detail:
            detail = (
                "the request body is not valid JSON in UTF-8; send a JSON object with Content-Type: application/json"
            )
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(exc.status_code, detail, kind)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        metrics.rejected.labels("validation").inc()
        if first.get("type") == "json_invalid":  # its loc is a character offset, not a field
            at = next((p for p in first.get("loc", ()) if isinstance(p, int)), None)
            return error_response(
                400,
                f"the request body is not valid JSON ({first.get('ctx', {}).get('error', 'bad JSON')}"
                f"{f' at character {at}' if at is not None else ''}); send a JSON object with "
                "Content-Type: application/json",
                "invalid_request_error",
                None,
            )
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return error_response(400, f"invalid request body at {where or 'body'}: {first.get('msg', 'bad value')}",
                              "invalid_request_error", where)

    @app.get("/health")
    async def health():
        h = without_file_paths(
            cluster.health(), model_dirs
        )  # open to all, key or not: a worker's error may name a file
        return JSONResponse(h, status_code=200 if h["status"] != "down" else 503)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {"id": model_name, "object": "model", "created": created, "owned_by": "minivllm", "root": model_name}
            ],
        }  # never the server's file path

    @app.get("/v1/cluster/snapshot")
    async def cluster_snapshot(fresh: bool = False):
        """`fresh=true` asks every worker for a new engine snapshot instead of its latest one."""
        snap = await in_thread(cluster.snapshot, fresh)
        return snap if api_key is not None else without_file_paths(snap, model_dirs)

    @app.post("/v1/cluster/workers/{name}/restart")
    async def restart_worker(name: str):
        """Replace one worker with a fresh process (dead or alive); the others keep serving.
        Calls while a restart of that worker is in progress wait for it instead of starting
        another (`Cluster.restart_worker_async`)."""
        if name not in cluster.workers:
            return error_response(404, f"no worker named {name!r}; workers: {', '.join(cluster.workers)}",
                                  "invalid_request_error", "name")
        try:
            await thread_future(cluster.restart_worker_async(name), f"the restart of worker {name!r}")
        except MinivllmError as exc:
            return error_response(503, str(exc), "service_unavailable")
        return cluster.health()

    @app.get("/metrics")
    async def prometheus():
        body = await in_thread(metrics.render)
        return PlainTextResponse(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def start(request: Request, body, *, prompt=None, messages=None, tools: ToolRequest | None = None,
                    default_max_tokens: int):
        """Validate and route; returns a stream or an error response."""
        if body.model not in (None, model_name):
            metrics.rejected.labels("model").inc()
            return error_response(404, f"model {body.model!r} is not served here; this server serves {model_name!r} "
                                       "(see /v1/models)", "invalid_request_error", "model")
        try:
            loop = asyncio.get_running_loop()
            context = tools.template_context() if tools is not None else None

            def submit() -> RequestStream:  # off the loop: a schema or grammar compiles in here
                params = body.sampling_params(default_max_tokens, tools)
                return cluster.submit(prompt, params, messages=messages, chat_context=context, loop=loop)

            stream = await in_thread(submit)
        except ConfigError as exc:
            metrics.rejected.labels("invalid").inc()
            return error_response(400, str(exc), "invalid_request_error", exc.field)
        except AdmissionRefused as exc:
            metrics.rejected.labels("queued_tokens").inc()
            return error_response(429, str(exc), "rate_limit_error", None, {"retry-after": "1"})
        except NoWorkerAvailable as exc:
            return error_response(503, str(exc), "service_unavailable")
        return stream

    def record(stream: RequestStream, arrival: float, first: float | None, gaps: list[float]) -> None:
        worker = stream.worker or "none"
        if first is not None:
            metrics.ttft.labels(worker).observe(first - arrival)
        for g in gaps:
            metrics.itl.labels(worker).observe(g)
        metrics.e2e.labels(worker).observe(time.monotonic() - arrival)
        # A request whose client left is cancelled; its abort event may not be back yet.
        metrics.requests.labels(worker, stream.finish_reason or "abort").inc()
        metrics.prompt_tokens.labels(worker).inc(len(stream.prompt_token_ids))
        metrics.generation_tokens.labels(worker).inc(len(stream.token_ids))

    async def complete(stream: RequestStream, events, event, arrival: float, first_time: float, chat: bool,
                       body, tools: ToolRequest | None):
        last, gaps = first_time, []
        while not event.finished:
            event = await events.__anext__()
            now = time.monotonic()
            gaps.append(now - last)
            last = now
        record(stream, arrival, first_time, gaps)
        if stream.finish_reason == "error" and (stream.error or "").startswith(CONSTRAINT_FAILED):
            # The schema or grammar admits no continuation of the output (a recursive schema
            # past llguidance's limits, say): the request's constraint, not the server, failed.
            return error_response(400, stream.error, "invalid_request_error", body.constraint_field)
        if stream.finish_reason == "error":
            return error_response(503 if "worker" in (stream.error or "") else 500, stream.error or "generation failed",
                                  "server_error")
        message, finish = {"role": "assistant", "content": stream.text}, stream.finish_reason
        if tools is not None and tools.parses_output:
            content, calls, finish = reply_calls(stream.text, finish, tools.names, tools.forced)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
        choice = ({"index": 0, "message": message, "finish_reason": finish, "logprobs": None} if chat else
                  {"index": 0, "text": stream.text, "finish_reason": finish, "logprobs": None})
        return {"id": stream.request_id, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": model_name, "choices": [choice],
                "usage": usage(stream), "minivllm": timing_extension(stream)}

    async def run(request: Request, body, *, chat: bool, prompt=None, messages=None, tools: ToolRequest | None = None):
        arrival = time.monotonic()
        started = await start(request, body, prompt=prompt, messages=messages, tools=tools,
                              default_max_tokens=CHAT_DEFAULT_MAX_TOKENS if chat else COMPLETION_DEFAULT_MAX_TOKENS)
        if isinstance(started, Response):
            return started
        stream: RequestStream = started
        events = stream.__aiter__()
        # Until the response starts streaming, a watcher cancels the request if the client
        # leaves (StreamingResponse watches for that itself afterwards).
        watcher = asyncio.create_task(_cancel_on_disconnect(request, stream))
        try:
            # Wait for the first event before answering, so a request its worker refuses
            # still gets a 4xx instead of a 200 stream carrying an error.
            first_event = await events.__anext__()
            first_time = time.monotonic()
            if stream.rejected is not None:
                metrics.rejected.labels("worker").inc()
                return error_response(400, stream.rejected["error"], "invalid_request_error", stream.rejected["field"])
            if not body.stream:
                return await complete(stream, events, first_event, arrival, first_time, chat, body, tools)
        finally:
            watcher.cancel()
        rid = stream.request_id
        async def sse():
            chunk_kind = "chat.completion.chunk" if chat else "text_completion"
            created_at = int(time.time())

            # Tool calls: content streams until a call may start, each call goes out whole at the end.
            splitter = ToolCallStream(tools.names, tools.forced) if tools is not None and tools.parses_output else None

            def chunk(text: str | None, finish: str | None, first_chunk: bool = False,
                      tool_calls: list[dict] | None = None) -> str:
                if chat:
                    delta = (
                        {"role": "assistant", "content": text or ""}
                        if first_chunk
                        else ({"content": text} if text else {})
                    )
                    if tool_calls:
                        delta["tool_calls"] = tool_calls
                    choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
                else:
                    choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
                payload = {
                    "id": rid,
                    "object": chunk_kind,
                    "created": created_at,
                    "model": model_name,
                    "choices": [choice],
                }
                if finish is not None:
                    payload["minivllm"] = timing_extension(stream)
                return f"data: {json.dumps(payload)}\n\n"

            last, gaps = first_time, []
            event = first_event
            first_chunk = True
            finished_normally = False
            try:
                while True:
                    if event.finished:
                        if event.finish_reason == "error":
                            err = error_body(event.error or "generation failed", "server_error").decode()
                            yield f"data: {err}\n\n"
                        elif splitter is None:
                            yield chunk(event.text, event.finish_reason, first_chunk)
                        else:
                            text = splitter.feed(event.text)
                            rest, calls, finish = splitter.finish(event.finish_reason)
                            if calls:
                                yield chunk(text + rest, None, first_chunk,
                                            [{"index": k, **call} for k, call in enumerate(calls)])
                                yield chunk(None, finish)
                            else:
                                yield chunk(text + rest, event.finish_reason, first_chunk)
                        break
                    text = event.text if splitter is None else splitter.feed(event.text)
                    if text or first_chunk:
                        yield chunk(text, None, first_chunk)
                        first_chunk = False
                    event = await events.__anext__()
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now
                if body.include_usage:
                    payload = {"id": rid, "object": chunk_kind, "created": created_at, "model": model_name,
                               "choices": [], "usage": usage(stream), "minivllm": timing_extension(stream)}
                    yield f"data: {json.dumps(payload)}\n\n"
                yield "data: [DONE]\n\n"
                finished_normally = True
            finally:
                # A disconnect closes this generator mid-stream: cancel the request.
                if not finished_normally:
                    stream.cancel()
                    try:
                        await events.aclose()
                    except (RuntimeError, asyncio.CancelledError):
                        pass
                record(stream, arrival, first_time, gaps)

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        try:
            prompt = body.prompt_input()
        except ConfigError as exc:
            metrics.rejected.labels("invalid").inc()
            return error_response(400, str(exc), "invalid_request_error", exc.field)
        return await run(request, body, chat=False, prompt=prompt)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        try:
            messages = body.chat_messages()
            tools = body.tool_request(cluster.tokenizer.chat_template)
        except ConfigError as exc:
            metrics.rejected.labels("invalid").inc()
            return error_response(400, str(exc), "invalid_request_error", exc.field)
        return await run(request, body, chat=True, messages=messages, tools=tools)

    return app


async def _cancel_on_disconnect(request: Request, stream: RequestStream, poll_s: float = 0.2) -> None:
    while not stream.finished:
        if await request.is_disconnected():
            stream.cancel()
            return
        await asyncio.sleep(poll_s)
