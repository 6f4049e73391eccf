"""A split request: prefill (and the first token) on one worker, decode on another, as
ONE request to its client (issue 43).

    stream = cluster.submit(prompt, params, placement=("cpu", "cpu#2"))

Why an explicit placement pair: the split is a decision about two workers at once, and
until the router prices it (the cost of moving the K/V against both sides' queues and
rates) the caller is the one who knows it pays; a pair is also what a test, a benchmark
or the notebook needs to force a split and compare it with the whole request on either
worker. `placement` names the prefill worker first, then the decode worker.

The path, in messages (protocol.py):
1. where the decode worker's pool is mappable (a CPU worker: cache/shared_pool_memory.py),
   it gets `reserve` for the prompt's full pages and answers `reserved` with its pages
   (the *landing*), which the controller forwards to the prefill worker (`landing`);
2. the prefill worker gets a `submit` with `export_after=1` and a segment name that the
   controller chose (kv_segment.py), so the controller can always unlink it by name;
3. after the step that gave the request its first token, that worker copies the K/V of
   its full pages straight into the landing's pages (kv_landing.py), or, without a
   landing in time, into the segment, sends `exported` (token ids, shapes, RNG state) and
   lets the request and its pages go;
4. the controller sends `import` with that description to the decode worker, which
   indexes the landed pages (or copies the segment into its pool and unlinks it),
   sends `imported` and streams the rest of the tokens.

A reservation ends with the import, or with `unreserve` once the request is over; the
controller sends that only after the prefill worker is done with the request (its
`exported` or terminal event, or its death), so no page is reused under a writer.

`SplitRequest` stands in the two workers' ledgers where a `RequestStream` would: the
handles push its events and fail it as they do any request's, and it forwards to the
client's one stream: the first worker's token(s), then the second's, one terminal event.
Cancelling at any moment reaches the worker that holds the request then (a cancel that
crosses the `exported` message ends the request here and unlinks the segment); a worker
that dies fails only the requests it held, naming itself, and their segments are unlinked.
The final metrics are the whole request's (prefill figures from the first worker, output
tokens from both, e2e as the controller saw it) with a `split` record: both workers, the
K/V bytes and tokens moved, and the milliseconds of each copy and of the whole handoff.

Not carried across yet (engine/handoff.py): a constraint's matcher, pending stop-string
text, penalties' view of the first worker's output; such requests are refused here.
"""

from __future__ import annotations

import collections
import threading
import time

from minivllm.errors import ConfigError
from minivllm.sampling.outputs import TokenEvent
from minivllm.sampling.sampling_params import SamplingParams
from minivllm.serving.kv_landing import zero_copy_requested
from minivllm.serving.kv_segment import segment_name, unlink_segment
from minivllm.serving.link_rate import LinkRate, measure_shared_memory_link
from minivllm.serving.request_stream import RequestStream
from minivllm.serving.router import NoWorkerAvailable
from minivllm.serving.split_pricing import SplitPricing

# Rows each worker of a local cluster keeps for split requests' prefill halves beyond its
# slots (EngineConfig.handoff_rows), unless the cluster is told otherwise (cluster.py).
DEFAULT_HANDOFF_ROWS = 2
PHASES = ("prefill", "transfer", "decode", "done")  # transfer: exported, not yet imported


def split_refusal(params: SamplingParams) -> tuple[str, str] | None:
    """(field, why) when this request's state cannot move between workers yet."""
    refused = [("structured", params.structured is not None, "a constraint's matcher"),
               ("stop", bool(params.stop), "pending stop-string text"),
               ("presence_penalty", params.presence_penalty != 0.0, "the penalties' view of the output"),
               ("frequency_penalty", params.frequency_penalty != 0.0, "the penalties' view of the output"),
               ("repetition_penalty", params.repetition_penalty != 1.0, "the penalties' view of the output")]
    return next(((field, what) for field, used, what in refused if used), None)


def split_engine_options(engine_options: dict, backend: str, workers: int) -> dict:
    """Where split requests are possible (local workers, more than one), each worker keeps
    DEFAULT_HANDOFF_ROWS beyond its slots unless told otherwise: a worker with every slot
    taken can still run a split's prefill half, which is when a split pays (a GPU at its
    slot cap sends new requests' decode to an idle CPU). The export path's switch is checked
    here too, before any worker starts (each worker checks it again at its own start)."""
    zero_copy_requested()  # MINIVLLM_EXPORT_ZERO_COPY: 0 or 1, else a ConfigError naming it
    if backend == "local" and workers > 1:
        return {"handoff_rows": DEFAULT_HANDOFF_ROWS, **engine_options}
    return engine_options


def check_split(placement, params: SamplingParams, workers: dict, backend: str) -> tuple[str, str]:
    """The (prefill, decode) worker names, or a ConfigError naming what cannot be split."""
    if backend != "local":
        raise ConfigError("placement", placement, f"split requests move K/V through local shared memory; the "
                                                  f"{backend} backend does not support them yet (use backend='local')")
    if not (isinstance(placement, (tuple, list)) and len(placement) == 2
            and all(isinstance(name, str) for name in placement)):
        raise ConfigError("placement", placement, "a pair of worker names: (prefill worker, decode worker)")
    prefill, decode = placement
    for name in placement:
        if name not in workers:
            raise ConfigError("placement", name, f"workers: {', '.join(workers) or '(none started)'}")
    if prefill == decode:
        raise ConfigError("placement", placement, "two different workers (or submit without placement)")
    refusal = split_refusal(params)
    if refusal is not None:
        field, what = refusal
        raise ConfigError(field, getattr(params, field), f"{what} does not move between workers yet: "
                                                         "submit this request without placement")
    kinds = {workers[name].device.kind for name in placement}
    if params.temperature > 0 and len(kinds) > 1:
        raise ConfigError("placement", placement, "a sampled request's RNG state moves only between workers of one "
                                                  "device kind: split it greedy (temperature=0) or on two such workers")
    for name in placement:
        if not workers[name].healthy:
            raise NoWorkerAvailable(f"placement {prefill} -> {decode}: worker {name} is {workers[name].state}")
    return prefill, decode


class SplitRequests:
    """The cluster's split requests: the live ones by id, and a log of the finished ones."""

    def __init__(self, cluster_id: str, history: int = 256):
        self.cluster_id = cluster_id
        self.link = LinkRate()  # measured by `measure_link` when the cluster starts
        self._live: dict[str, SplitRequest] = {}
        self._lock = threading.Lock()
        self.records: collections.deque[dict] = collections.deque(maxlen=history)
        self.counters = {"started": 0, "handed_off": 0, "finished": 0, "failed": 0, "kv_bytes": 0,
                         **{f"cancelled_in_{p}": 0 for p in PHASES[:3]}}

    def measure_link(self, backend: str, workers: int) -> None:
        """At start-up, where splits are possible: what moving K/V between two workers costs."""
        if backend == "local" and workers > 1:
            self.link = measure_shared_memory_link(repeats=2)

    def share_pools(self, backend: str, handles: list) -> None:
        """Each local worker maps its peers' mappable KV pools now, in the background (a GPU
        worker host-registers them too), so a split's first write into a peer's pages does
        not wait for that: pinning a pool of gigabytes takes a good part of a second. Called
        at start-up and after a worker is replaced (the others learn its new pool)."""
        if backend != "local":
            return
        pools = {h.name: (h.info or {}).get("kv_landing") for h in handles if h.healthy}
        for h in handles:
            peers = [pool for name, pool in pools.items() if pool and name != h.name]
            if peers and h.healthy:
                h.prefetch_pools(peers)

    def pricing(self, params: SamplingParams, handles: list, backend: str) -> SplitPricing | None:
        """The router's split inputs (used under router="cost+split"), or None where no split
        may be priced: another backend, a request that cannot move, fewer than two workers
        that could import (healthy, prefix cache on, a state snapshot in), no link rate yet."""
        if backend != "local" or split_refusal(params) is not None or not self.link.known:
            return None
        kv, pages, kinds = {}, {}, {}
        for h in handles:
            snap = h.snapshot or {}
            pool = snap.get("kv") or {}
            if h.healthy and pool.get("total_pages") and (snap.get("prefix_cache") or {}).get("enabled", True):
                kv[h.name] = pool["bytes"] / (pool["total_pages"] * pool["page_size"])
                pages[h.name], kinds[h.name] = pool["page_size"], h.device.kind
        if len(kv) < 2:
            return None
        return SplitPricing(self.link.bytes_per_s(), kv, pages, kinds, params.temperature > 0)

    def start(self, stream: RequestStream, prompt_ids: list[int], params: SamplingParams, prefill, decode,
              decision: dict | None = None) -> dict:
        """Send the request to `prefill` (a WorkerHandle) to be handed to `decode`; returns
        the routing record (`decision`, the router's, or one saying it was placed)."""
        split = SplitRequest(self, stream, prefill, decode, params, segment_name(self.cluster_id, stream.request_id))
        with self._lock:
            self._live[stream.request_id] = split
            self.counters["started"] += 1
        stream.worker = prefill.name
        stream.decision = decision or {"request_id": stream.request_id, "time": time.time(), "policy": "placement",
                           "reason": f"split requested: prefill on {prefill.name}, decode on {decode.name}",
                           "prompt_tokens": len(prompt_ids), "max_tokens": params.max_tokens,
                           "chosen": prefill.name, "split": {"prefill": prefill.name, "decode": decode.name},
                           "candidates": []}
        # Where the decode worker's pool is mappable (a CPU worker), it reserves pages for the
        # prompt's full pages now, while the prefill runs, and the prefill worker writes into
        # them (kv_landing.py); else, or if the answer comes late, the K/V go through the segment.
        # The split's lock is held until the prefill worker has its submit: the reservation
        # may come back first, and its landing must reach that worker after the request.
        # B's ledger carries the decode half from now on, so routing the next request sees it.
        page = (decode.info or {}).get("page_size", 1)  # B recomputes the tail past A's last full page
        decode.expect(stream.request_id, len(prompt_ids) + 1 - len(prompt_ids) // page * page, params.max_tokens - 1,
                      context_tokens=len(prompt_ids) + 1)
        pool = (decode.info or {}).get("kv_landing")
        ps = pool["shape"][2] if pool else 0
        with split._lock:
            landing = bool(pool) and len(prompt_ids) >= ps \
                and decode.reserve(split, prompt_ids[:len(prompt_ids) // ps * ps])
            split.reserve_sent = landing
            prefill.submit(split, prompt_ids, params, 0,
                           export={"export_after": 1, "segment": split.segment, "await_landing": landing,
                                   "landing_pool": pool if landing else None})
        return stream.decision

    def cancel(self, request_id: str) -> bool:
        """Cancel a live split request; False if `request_id` is not one."""
        with self._lock:
            split = self._live.get(request_id)
        if split is None:
            return False
        split.cancel()
        return True

    def ended(self, split: "SplitRequest", reason: str | None, phase: str) -> None:
        """`phase`: where a cancelled request was when the cancel came, else where it ended."""
        with self._lock:
            self._live.pop(split.request_id, None)
            key = (f"cancelled_in_{phase}" if reason == "abort" else "failed" if reason == "error" else "finished")
            self.counters[key] += 1
            self.records.append(dict(split.record, finish_reason=reason, ended_in=phase))

    def handed_off(self, nbytes: int, copy_ms: float) -> None:
        with self._lock:
            self.counters["handed_off"] += 1
            self.counters["kv_bytes"] += nbytes
            self.link.observe(nbytes, copy_ms)

    def stop(self) -> None:
        """The cluster is stopping: no segment may outlive it."""
        with self._lock:
            live = list(self._live.values())
        for split in live:
            unlink_segment(split.segment)

    def snapshot(self) -> dict:
        with self._lock:
            return {"counters": dict(self.counters), "link": self.link.as_dict(),
                    "live": {rid: s.phase for rid, s in self._live.items()},
                    "recent": list(self.records)[-32:]}


class SplitRequest:
    """One split request in the workers' ledgers (the stream interface WorkerHandle uses:
    request_id, prompt, push, fail, plus exported / imported)."""

    def __init__(self, owner: SplitRequests, stream: RequestStream, prefill, decode, params: SamplingParams,
                 segment: str):
        self.owner, self.stream, self.prefill, self.decode = owner, stream, prefill, decode
        self.params, self.segment = params, segment
        self.request_id, self.prompt = stream.request_id, stream.prompt
        self.phase = "prefill"
        self.cancelled = False
        self.cancelled_in: str | None = None  # the phase a cancel found it in
        self.reserve_sent = False  # the decode worker was asked for pages (kv_landing.py)
        self.created = time.perf_counter()
        self._lock = threading.RLock()
        self.record: dict = {"request_id": self.request_id, "prefill_worker": prefill.name,
                             "decode_worker": decode.name, "segment": segment, "handed_off": False,
                             "landing": None}

    # -- from the decode worker's reader thread, while the prefill runs -----------------------

    def reserved(self, msg: dict) -> None:
        """The decode worker's pages for our K/V (or None): forwarded to the prefill worker
        while it still holds the request; otherwise handed straight back."""
        landing = msg.get("landing")
        with self._lock:
            self.record["landing"] = (None if landing is None
                                      else {"have": landing["have"], "pages": len(landing["pages"])})
            self.record["reserved_after_ms"] = (time.perf_counter() - self.created) * 1e3
            if landing is not None and self.phase == "prefill" and not self.cancelled:
                self.prefill.send_landing(self.request_id, landing)
                return
        if landing is None:
            self.record["landing_error"] = msg.get("error")
            self.prefill.send_landing(self.request_id, None)  # no need to wait for it: the segment then
        else:
            self.decode.unreserve(self.request_id)  # the request is past its prefill, or over

    # -- from the prefill worker's reader thread --------------------------------------------

    def exported(self, msg: dict) -> None:
        handoff = msg["handoff"]
        with self._lock:
            self.record.update(tokens_on_prefill_worker=len(handoff["output_ids"]), kv_bytes=handoff["nbytes"],
                               kv_tokens=handoff.get("landed_tokens", len(handoff["kv_token_ids"])),
                               link_bytes=handoff.get("link_bytes", handoff["nbytes"]),
                               write_ms=handoff["write_ms"], landing_error=handoff.get("landing_error"),
                               attach_ms=handoff.get("attach_ms"),
                               export_ms=msg["export_ms"], started_at=msg["started_at"],
                               prefill_metrics=msg["metrics"])
            if self.cancelled or self.phase != "prefill":
                # The cancel crossed the export: the prefill worker has let the request go,
                # the decode worker never heard of it, so it ends here.
                self.cancelled_in = "transfer" if self.cancelled else self.cancelled_in
                unlink_segment(self.segment)
                self.push(TokenEvent(self.request_id, -1, "", finished=True, finish_reason="abort"))
                return
            self.phase = "transfer"
            self.stream.worker = self.decode.name
            self.decode.import_handoff(self, handoff, self.params)  # fails us at once if the worker is down

    # -- from the decode worker's reader thread ---------------------------------------------

    def imported(self, msg: dict) -> None:
        with self._lock:
            nbytes = self.record.get("kv_bytes", 0)
            copy_ms = self.record.get("write_ms", 0.0) + msg["read_ms"]
            started = self.record.get("started_at", msg["finished_at"])
            # The link's own rate: the bytes that crossed it over the time they took, A's
            # write (gather, conversion, DMA) plus, through a segment, B's copy out of it.
            # A landing's read_ms is B's bookkeeping only (the K/V are in its pages already).
            link_ms = self.record.get("write_ms", 0.0) + (0.0 if msg.get("landed") else msg["read_ms"])
            link_bytes = self.record.get("link_bytes", nbytes)
            self.record.update(handed_off=True, read_ms=msg["read_ms"], import_ms=msg["import_ms"],
                               transport="landing" if msg.get("landed") else "segment",
                               handoff_ms=(msg["finished_at"] - started) * 1e3,
                               copy_mb_per_s=nbytes / 1e6 / (copy_ms / 1e3) if copy_ms > 0 else None,
                               link_ms=link_ms,
                               link_mb_per_s=link_bytes / 1e6 / (link_ms / 1e3) if link_ms > 0 else None)
            if self.phase == "transfer":
                self.phase = "decode"
        self.owner.handed_off(nbytes, copy_ms)

    # -- the stream interface (either worker's reader thread) --------------------------------

    def push(self, event: TokenEvent, metrics: dict | None = None) -> None:
        if event.finished:
            with self._lock:
                phase, self.phase = self.phase, "done"
            if phase == "done":  # a second terminal event: the stream counts it, never delivers it
                self.stream.push(event, metrics)
                return
            unlink_segment(self.segment)  # a no-op unless it ended mid-transfer
            self.decode.forget(self.request_id)  # a no-op once imported
            if self.reserve_sent:  # a no-op once imported; the prefill worker is done writing by now
                self.decode.unreserve(self.request_id)
            metrics = self._whole_metrics(metrics)
            self.owner.ended(self, event.finish_reason, self.cancelled_in or phase)
        self.stream.push(event, metrics)

    def fail(self, message: str, *, rejected_field: str | None = None, rejected: bool = False) -> None:
        with self._lock:
            if rejected and self.phase == "prefill":  # refused before any token: a 4xx for the client
                self.stream.rejected = {"field": rejected_field, "error": message}
        self.push(TokenEvent(self.request_id, -1, "", finished=True, finish_reason="error", error=message))

    def cancel(self) -> None:
        with self._lock:
            if self.phase == "done":
                return
            self.cancelled, self.cancelled_in = True, self.phase
            holder = self.prefill if self.phase == "prefill" else self.decode
        holder.abort(self.request_id)  # a no-op where the request already left (see exported)

    # -- helpers ------------------------------------------------------------------------------

    def _whole_metrics(self, last: dict | None) -> dict | None:
        """The request's metrics as one request: the prefill worker's prompt figures, both
        workers' output tokens, e2e from submission as the controller saw it."""
        first = self.record.get("prefill_metrics")
        record = {k: v for k, v in self.record.items() if k not in ("prefill_metrics", "started_at")}
        if first is None or last is None or last is first:
            return None if last is None else {**last, "split": record}
        e2e = time.perf_counter() - self.stream.submitted_at
        out = first["output_tokens"] + last["output_tokens"]
        ttft = first["time_to_first_token_s"]
        return {**last, "prompt_tokens": first["prompt_tokens"], "cached_prompt_tokens": first["cached_prompt_tokens"],
                "queue_time_s": first["queue_time_s"], "time_to_first_token_s": ttft, "output_tokens": out,
                "e2e_s": e2e, "preemptions": first["preemptions"] + last["preemptions"],
                "prefill_tokens_per_s": first["prefill_tokens_per_s"],
                "decode_tokens_per_s": (out - 1) / (e2e - ttft) if out > 1 and e2e > ttft else 0.0,
                "split": {**record, "prefill_metrics": first, "decode_metrics": last}}
