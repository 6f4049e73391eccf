"""The soak's client: one asyncio loop, one connection per request (no keep-alive), so a cancel
or a disconnect really closes it; every request ends exactly once as one of OUTCOMES."""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from collections import Counter

from minivllm.reliability.workload import Plan, Record, SoakSettings


def _first_choice(obj: dict) -> dict | None:
    choices = obj.get("choices") or []
    return choices[0] if choices else None


async def _exchange(client, plan: Plan, rec: Record, first_chunk: asyncio.Event | None = None) -> None:
    import httpx

    path = "/v1/chat/completions" if plan.endpoint == "chat" else "/v1/completions"
    try:
        if not plan.stream:
            r = await client.post(path, json=plan.body)
            rec.t_headers = rec.t_first = time.perf_counter()
            rec.status = r.status_code
            if r.status_code != 200:
                rec.end("http_error", r.text[:500])
                return
            try:
                data = r.json()
                choice = _first_choice(data)
                rec.request_id = data.get("id")
                rec.worker = (data.get("minivllm") or {}).get("worker")
                rec.finish_reason = choice.get("finish_reason") if choice else None
                u = data.get("usage") or {}
                rec.prompt_tokens, rec.completion_tokens = u.get("prompt_tokens"), u.get("completion_tokens")
            except (ValueError, AttributeError) as exc:
                rec.end("protocol_error", f"bad JSON body: {exc}: {r.text[:200]}")
                return
            if rec.finish_reason in ("stop", "length"):
                rec.end("finished")
            else:
                rec.end("protocol_error", f"finish_reason {rec.finish_reason!r}: {r.text[:300]}")
            return

        async with client.stream("POST", path, json=plan.body) as r:
            rec.t_headers = time.perf_counter()
            rec.status = r.status_code
            if r.status_code != 200:
                body = (await r.aread()).decode(errors="replace")
                rec.end("http_error", body[:500])
                return
            async for line in r.aiter_lines():
                if not line or line.startswith(":"):
                    continue
                if not line.startswith("data: "):
                    rec.end("protocol_error", f"not an SSE data line: {line[:200]!r}")
                    return
                payload = line[6:]
                if payload == "[DONE]":
                    rec.got_done = True
                    break
                try:
                    obj = json.loads(payload)
                except ValueError:
                    rec.end("protocol_error", f"bad JSON chunk: {payload[:200]!r}")
                    return
                if "error" in obj:
                    rec.end("stream_error", json.dumps(obj["error"])[:500])
                    return
                rec.chunks += 1
                if rec.t_first is None:
                    rec.t_first = time.perf_counter()
                    if first_chunk is not None:
                        first_chunk.set()
                rec.request_id = rec.request_id or obj.get("id")
                choice = _first_choice(obj)
                if choice and choice.get("finish_reason"):
                    rec.finish_reason = choice["finish_reason"]
                if obj.get("minivllm"):
                    rec.worker = obj["minivllm"].get("worker") or rec.worker
                if obj.get("usage"):
                    rec.prompt_tokens = obj["usage"].get("prompt_tokens")
                    rec.completion_tokens = obj["usage"].get("completion_tokens")
                if plan.action == "disconnect" and rec.chunks >= (plan.disconnect_after_chunks or 1):
                    rec.end("disconnected")
                    return  # leaving `async with` closes the response and its connection
            if not rec.got_done:
                rec.end("protocol_error", f"stream ended without [DONE] after {rec.chunks} chunks")
            elif rec.finish_reason not in ("stop", "length"):
                rec.end("protocol_error", f"stream ended with finish_reason {rec.finish_reason!r}")
            else:
                rec.end("finished")
    except httpx.HTTPError as exc:
        rec.end("transport_error", f"{type(exc).__name__}: {exc}"[:500])


async def _one(client, plan: Plan, rec: Record, typical_e2e_s: float, typical_decode_s: float) -> None:
    rec.t_start = time.perf_counter()
    try:
        if plan.action != "cancel":
            await _exchange(client, plan, rec)
        else:
            first = asyncio.Event()
            task = asyncio.create_task(_exchange(client, plan, rec, first))
            if plan.cancel_mode == "early":
                delay = plan.cancel_after_s
            elif plan.cancel_mode == "timed":
                delay = plan.cancel_at_fraction * typical_e2e_s
            else:  # mid_stream: wait for the first chunk (or the end), then a while
                waiter = asyncio.create_task(first.wait())
                await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                delay = plan.cancel_at_fraction * typical_decode_s
            rec.cancel_after_s = delay
            done, _ = await asyncio.wait({task}, timeout=delay)
            if not done and task.cancel():
                t = time.perf_counter()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                if rec.outcome is None:
                    rec.cancel_phase = ("before_headers" if rec.t_headers is None else
                                        "before_first_chunk" if rec.chunks == 0 else "mid_stream")
                    rec.end("cancelled", t=t)
            else:
                await task  # finished before its cancel: re-raises a client bug, if any
    except Exception as exc:  # noqa: BLE001 - a bug in this client must still end the request once
        rec.end("protocol_error", f"client error: {exc!r}"[:500])
    if rec.outcome is None:
        rec.end("protocol_error", "client bug: the request ended without an outcome")


async def drive(url: str, plans: list[Plan], schedule: list[tuple], settings: SoakSettings, *,
                api_key: str | None = None, progress: bool = True) -> tuple[list[Record], float, float]:
    """Send the plans per the schedule (all of them, or those launched before `settings.max_duration_s`);
    returns (records of the sent ones, t_first_send, t_last_end) in perf_counter time."""
    import httpx

    records = [Record(p.index, p.endpoint, p.stream, p.action,
                      int(p.body.get("max_tokens") or p.body.get("max_completion_tokens") or 0),
                      bool(p.body.get("ignore_eos")), bool(p.body.get("stop"))) for p in plans]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # No keep-alive: every request has its own connection, so a cancel or a disconnect closes it.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    timeout = httpx.Timeout(settings.request_timeout_s, connect=60.0)
    in_flight: set[asyncio.Task] = set()
    done_count = launched = 0
    next_report = max(1, len(plans) // 10)
    t_origin = time.perf_counter()

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout, headers=headers) as client:
        cursor = iter(zip(plans, records))

        def launch() -> None:
            nonlocal launched
            plan, rec = next(cursor)
            launched += 1
            # Cancels land at a fraction of the recent median latency, so they hit queued,
            # prefilling and decoding requests alike whatever the load does to latency.
            window = [r for r in records[max(0, plan.index - 200):plan.index] if r.outcome == "finished"][-50:]
            e2e = [r.t_end - r.t_start for r in window]
            decode = [r.t_end - r.t_first for r in window if r.stream and r.t_first is not None]
            task = asyncio.create_task(_one(client, plan, rec, statistics.median(e2e) if len(e2e) >= 5 else 2.0,
                                            statistics.median(decode) if len(decode) >= 5 else 1.0))
            in_flight.add(task)

            def finished(t: asyncio.Task) -> None:
                nonlocal done_count, next_report
                in_flight.discard(t)
                done_count += 1
                if progress and done_count >= next_report:
                    counts = Counter(r.outcome for r in records if r.outcome)
                    print(f"soak: {done_count}/{len(plans)} done after {time.perf_counter() - t_origin:.0f} s: "
                          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), flush=True)
                    next_report += max(1, len(plans) // 10)

            task.add_done_callback(finished)

        deadline = t_origin + settings.max_duration_s if settings.max_duration_s else math.inf
        for phase in schedule:
            if time.perf_counter() > deadline:
                break
            if phase[0] == "burst":
                for _ in range(phase[1]):
                    launch()
                while len(in_flight) > settings.drain_to:
                    await asyncio.sleep(0.05)
            else:
                _, gap, offsets = phase
                t0 = time.perf_counter()
                for off in offsets:
                    await asyncio.sleep(max(0.0, t0 + off - time.perf_counter()))
                    if time.perf_counter() > deadline:
                        break
                    launch()
                await asyncio.sleep(max(0.0, t0 + gap - time.perf_counter()))
        while in_flight:
            await asyncio.wait(set(in_flight))
    if launched < len(records) and progress:
        print(f"soak: max_duration_s={settings.max_duration_s}: sent {launched} of {len(records)} requests", flush=True)
    records = records[:launched]
    t_end = max((r.t_end or t_origin) for r in records) if records else t_origin
    return records, t_origin, t_end
