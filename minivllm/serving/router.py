"""Which worker gets a request: the routing policies and their decision log.

Policies (`--router`):
    round-robin       the next healthy worker in turn
    least-loaded      fewest requests in flight (active + queued), then least decode work
    forced:<worker>   always that worker ("cpu", "cuda:1", ...); an error if it is down
    cost              the lowest estimated time until the incoming request would be done:
    cost+split        cost, also pricing "prefill on one worker, decode on another"
                      (split_pricing.py; local workers), taken where it is clearly lowest

        finish = when a slot frees for it + its own prefill + max_tokens / per-request rate
        score  = finish
        drain  = prefill tokens / prefill_tps + decode tokens / decode_tps(concurrency)
                 (shown beside it, not scored)

    `finish` is when the incoming request itself would be done. A request decodes at the
    per-request rate decode_tps(c) / c, concurrency c = min(max active, requests the worker
    would hold), and, when every slot (max_active_requests) is taken, only starts when one
    frees: `finish` replays the worker's FCFS slots (active requests free theirs after
    their remaining work, queued requests take the earliest slots in order, then the
    incoming request).

    `drain` is mini-vllm-rs's score, with measured rates: how long until the worker has
    worked off everything it holds (prefill tokens = existing work's remaining prompt
    tokens, queued requests keeping the cache estimate they were routed with, + the
    incoming prompt net of this worker's prefix cache; decode tokens = active requests'
    unused max_tokens + queued requests' full budgets + the incoming budget). It misleads
    both ways, so it is reported and no longer scored:
    - it assumes the incoming request gets the worker's whole throughput: on the H200 box
      it sent a request to a CPU worker whose 4 slots were full, which finished seconds
      after the GPU had drained everything else;
    - it makes the request wait for the others' tokens, which a batching worker decodes
      beside it: on an H100 (h100-s49 disaggregation bench) a GPU with 24 long answers in
      flight scored 6.5 s by drain for a 128-token answer it served in 0.37 s, so the
      router sent the request to decode on the CPU, which took 1.9 s.
    The decode rate is taken at the context the rows would hold (worker_rates.py, the
    context term): the worker's running requests' contexts plus the incoming request's
    mean one (its prompt and half its answer), so a long prompt's decode on a CPU is
    priced at the K/V it reads, not at calibration's 128 tokens. Split decode halves on
    their way to a worker count as rows with their prompt's K/V.
    A worker without measured rates cannot be priced: then the decision falls back to
    least-loaded and says so.

Every decision keeps every candidate's inputs, terms and score, and the choice, in a ring
buffer that `snapshot()` serves (the router widget draws it).
"""

from __future__ import annotations

import collections
import heapq
import itertools
import time
from dataclasses import asdict, dataclass, field

from minivllm.errors import ConfigError, MinivllmError
from minivllm.serving.split_pricing import SPLIT_MARGIN, SplitPricing, price_splits

ROUTER_POLICIES = ("round-robin", "least-loaded", "forced:<worker>", "cost", "cost+split")


class NoWorkerAvailable(MinivllmError):
    """No healthy worker can take the request."""


@dataclass
class IncomingRequest:
    request_id: str
    prompt_tokens: int
    max_tokens: int


@dataclass
class Candidate:
    """One worker as the router sees it when a request arrives."""

    worker: str
    healthy: bool
    active: int  # requests running (holding pages) or already producing tokens
    queued: int  # routed here, not running yet
    existing_prefill_tokens: int
    existing_decode_tokens: int
    max_active: int
    cached_tokens: int = 0  # of the incoming prompt, held by this worker's prefix cache
    handoff_rows: int = 0  # rows beyond max_active for split requests' prefill halves (EngineConfig)
    handoffs: int = 0  # such prefill halves here now (their work is in existing_*, not in the slots)
    context_tokens: int = 0  # the running requests' contexts (prompt + tokens so far) and the arriving ones', summed
    arriving: int = 0  # split decode halves on their way here (in `queued`; their K/V in context_tokens)
    decode_context: int | None = None  # the rows' context decode_tps was taken at, filled in by the cost policy
    prefill_tps: float | None = None
    decode_tps: float | None = None  # at `concurrency`, filled in by the cost policy
    concurrency: int = 1
    incoming_prefill_tokens: int = 0
    incoming_decode_tokens: int = 0
    # Per request, in FCFS order: [remaining prefill tokens, remaining decode tokens].
    active_work: list[list[int]] = field(default_factory=list)
    queued_work: list[list[int]] = field(default_factory=list)
    prefill_s: float | None = None  # drain's prefill term
    decode_s: float | None = None  # drain's decode term
    drain_s: float | None = None
    finish_s: float | None = None
    score: float | None = None

    @property
    def in_flight(self) -> int:
        return self.active + self.queued


def parse_router_policy(policy: str) -> str:
    if policy in ("round-robin", "least-loaded", "cost", "cost+split"):
        return policy
    if isinstance(policy, str) and policy.startswith("forced:") and len(policy) > len("forced:"):
        return policy
    raise ConfigError(
        "router", policy, "allowed: round-robin, least-loaded, cost, cost+split, forced:<worker> (e.g. forced:cuda:0)"
    )


class Router:
    def __init__(self, policy: str = "cost", *, history: int = 256):
        self.policy = parse_router_policy(policy)
        self.decisions: collections.deque[dict] = collections.deque(maxlen=history)
        self._turn = itertools.count()
        self.counters = {"decisions": 0, "fallbacks": 0, "no_worker": 0, "splits": 0}

    def choose(self, incoming: IncomingRequest, candidates: list[Candidate], rates: dict | None = None,
               split: SplitPricing | None = None) -> dict:
        """Pick a worker; `rates` maps worker name -> WorkerRates (the cost policy's input).
        With `split` under cost+split, split candidates are priced too (split_pricing.py)
        and the record's "split" says {"prefill", "decode"} when one wins.
        Returns the decision record (also kept in `decisions`)."""
        healthy = [c for c in candidates if c.healthy]
        if not healthy:
            self.counters["no_worker"] += 1
            raise NoWorkerAvailable("no healthy worker can take the request: every worker is down or stopped; "
                                    "restart the cluster or a worker (Cluster.restart_worker)")
        for c in candidates:
            c.incoming_prefill_tokens = max(0, incoming.prompt_tokens - c.cached_tokens)
            c.incoming_decode_tokens = incoming.max_tokens
        reason, splits, won = self.policy, [], None
        if self.policy == "round-robin":
            chosen = self._round_robin(candidates)
        elif self.policy == "least-loaded":
            chosen = self._least_loaded(healthy)
        elif self.policy.startswith("forced:"):
            chosen = self._forced(candidates)
        else:
            chosen, reason = self._cost(healthy, rates or {}, incoming)
            if split is not None and self.policy == "cost+split" and reason == "cost":
                splits = price_splits(incoming.prompt_tokens, incoming.max_tokens, healthy, split, incoming_finish_s)
                won = min(splits, key=lambda s: s.score, default=None)
                if won is not None and won.score < SPLIT_MARGIN * chosen.score:
                    chosen = next(c for c in healthy if c.worker == won.prefill)
                    reason = f"cost (split: prefill on {won.prefill}, decode on {won.decode})"
                    self.counters["splits"] += 1
                else:
                    won = None
        record = {"request_id": incoming.request_id, "time": time.time(), "policy": self.policy, "reason": reason,
                  "prompt_tokens": incoming.prompt_tokens, "max_tokens": incoming.max_tokens,
                  "chosen": chosen.worker, "candidates": [asdict(c) for c in candidates],
                  "split_candidates": [asdict(s) for s in splits],
                  "split": None if won is None else {"prefill": won.prefill, "decode": won.decode}}
        self.decisions.append(record)
        self.counters["decisions"] += 1
        return record

    def _round_robin(self, candidates: list[Candidate]) -> Candidate:
        # The cursor walks over all workers so a worker that comes back gets its turns again.
        for _ in range(len(candidates)):
            c = candidates[next(self._turn) % len(candidates)]
            if c.healthy:
                return c
        raise AssertionError("unreachable: a healthy candidate exists")

    @staticmethod
    def _least_loaded(healthy: list[Candidate]) -> Candidate:
        return min(healthy, key=lambda c: (c.in_flight, c.existing_decode_tokens))

    def _forced(self, candidates: list[Candidate]) -> Candidate:
        target = self.policy[len("forced:"):]
        for c in candidates:
            if c.worker == target:
                if not c.healthy:
                    self.counters["no_worker"] += 1
                    raise NoWorkerAvailable(
                        f"router forced:{target}: worker {target} is down; restart it or pick another policy"
                    )
                return c
        raise ConfigError("router", self.policy, f"no worker is named {target!r}; workers: "
                          + ", ".join(c.worker for c in candidates))

    def _cost(self, healthy: list[Candidate], rates: dict, incoming: IncomingRequest) -> tuple[Candidate, str]:
        for c in healthy:
            r = rates.get(c.worker)
            c.concurrency = max(1, min(c.max_active, c.in_flight + 1))
            if r is None or not r.known:
                continue
            c.prefill_tps = r.prefill_rate()
            c.decode_context = decode_context(c, incoming)
            c.decode_tps = c.concurrency / r.decode_step_s(c.concurrency, c.decode_context)
            c.prefill_s = (c.existing_prefill_tokens + c.incoming_prefill_tokens) / c.prefill_tps
            c.decode_s = (c.existing_decode_tokens + c.incoming_decode_tokens) / c.decode_tps
            c.drain_s = c.prefill_s + c.decode_s
            c.finish_s = incoming_finish_s(c)
            c.score = c.finish_s
        priced = [c for c in healthy if c.score is not None]
        if len(priced) < len(healthy):
            self.counters["fallbacks"] += 1
            unpriced = ", ".join(c.worker for c in healthy if c.score is None)
            return self._least_loaded(healthy), f"least-loaded (no measured rates yet for {unpriced})"
        return min(priced, key=lambda c: c.score), "cost"

    def snapshot(self) -> dict:
        return {"policy": self.policy, "counters": dict(self.counters), "decisions": list(self.decisions)}


def decode_context(c: Candidate, incoming: IncomingRequest) -> int:
    """The context the `c.concurrency` rows decoding beside the incoming request would hold:
    its own mean (prompt + half its answer) and the others' share of the contexts of the
    rows that hold K/V (running, or split decode halves arriving with their prompt's)."""
    others = c.concurrency - 1
    rows = c.active + c.arriving
    running = c.context_tokens * min(1.0, others / rows) if rows else 0
    return round(running) + incoming.prompt_tokens + incoming.max_tokens // 2


def incoming_finish_s(c: Candidate, arrival: float = 0.0) -> float:
    """When the incoming request would be done on this worker: its FCFS slots replayed
    at the per-request decode rate decode_tps / concurrency; it takes a slot no earlier
    than `arrival` seconds from now (a split request's decode half arrives later)."""
    per_request = c.decode_tps / c.concurrency

    def duration(prefill: int, decode: int) -> float:
        return prefill / c.prefill_tps + decode / per_request

    slots = [duration(p, d) for p, d in c.active_work]
    slots += [0.0] * max(0, c.max_active - len(slots))
    heapq.heapify(slots)
    for p, d in c.queued_work:
        heapq.heappush(slots, heapq.heappop(slots) + duration(p, d))
    return max(heapq.heappop(slots), arrival) + duration(c.incoming_prefill_tokens, c.incoming_decode_tokens)
