"""One request's state inside the engine.

The token sequence is `prompt_ids + output_ids`; `num_computed` of them have K/V in the
request's pages. The next forward computes `all_ids[num_computed:]` — the whole rest of
the prompt (possibly in chunks) while prefilling, exactly one token while decoding, and
everything again after a preemption, which drops the pages and sets `num_computed` to 0.
"""

from __future__ import annotations

import dataclasses
import enum
import time

import torch

from minivllm.gguf.detokenizer import StreamingDetokenizer
from minivllm.sampling.outputs import RequestMetrics
from minivllm.sampling.sampler import make_generator
from minivllm.sampling.sampling_params import SamplingParams
from minivllm.sampling.stop_strings import StopStringMatcher


class Status(str, enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, to be recomputed
    FINISHED = "finished"


class Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                 tokenizer, device: torch.device, arrival_index: int):
        self.id = request_id
        self.prompt = prompt
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.status = Status.WAITING
        self.arrival_index = arrival_index  # submission order: fcfs and "newest" for preemption
        self.num_computed = 0
        self.block_table: list[int] = []  # KV pages; written only by cache/kv_manager.py
        # Prefix cache bookkeeping: chain keys of the full blocks hashed so far (content
        # keys, valid across preemptions), tokens restored at the latest admission, and
        # how many leading block-table pages are already published or were restored.
        self.cache_keys: list[int] = []
        self.restored_tokens = 0
        self.published_pages = 0
        self.spec = None  # spec.drafter.SpecState when the engine speculates
        self.constraint = None  # sampling.constraint.TokenConstraint for params.structured
        self.generator = make_generator(params, device)
        self.detok = StreamingDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
        self.stops = StopStringMatcher(params.stop)
        self.text = ""
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.metrics = RequestMetrics(prompt_tokens=len(prompt_ids))
        self.arrival_time = time.perf_counter()
        self.first_scheduled_time: float | None = None
        # The prefill half of a split request: it leaves for another engine after its first
        # token, so it may run in one of the engine's handoff rows when every slot is taken.
        self.handoff = False

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed

    @property
    def phase(self) -> str:
        if self.status == Status.FINISHED:
            return "finished"
        return "decode" if self.output_ids and self.remaining == 1 else "prefill"

    def since_arrival(self) -> float:
        return time.perf_counter() - self.arrival_time

    def describe(self) -> dict:
        """This request's row in engine snapshots."""
        return {
            "id": self.id,
            "status": self.status.value,
            "phase": self.phase,
            "prompt_tokens": len(self.prompt_ids),
            "computed_tokens": self.num_computed,
            "output_tokens": len(self.output_ids),
            "max_tokens": self.params.max_tokens,
            "restored_tokens": self.restored_tokens,
            "pages": len(self.block_table),
            "block_table": list(self.block_table),
            "preemptions": self.metrics.preemptions,
            "speculation": self.spec.describe() if self.spec is not None else None,
        }


class RequestView:
    """A read-only, live view of one request (`LLMEngine.request_state`): attributes read
    the request's current state; lists come back as copies."""

    __slots__ = ("_req",)

    def __init__(self, req: Request):
        self._req = req

    id = property(lambda self: self._req.id)
    status = property(lambda self: self._req.status)
    phase = property(lambda self: self._req.phase)
    finish_reason = property(lambda self: self._req.finish_reason)
    error = property(lambda self: self._req.error)
    text = property(lambda self: self._req.text)
    num_computed = property(lambda self: self._req.num_computed)
    num_tokens = property(lambda self: self._req.num_tokens)
    restored_tokens = property(lambda self: self._req.restored_tokens)
    prompt_ids = property(lambda self: list(self._req.prompt_ids))
    output_ids = property(lambda self: list(self._req.output_ids))
    block_table = property(lambda self: list(self._req.block_table))
    metrics = property(lambda self: dataclasses.replace(self._req.metrics))

    @property
    def finished(self) -> bool:
        return self._req.finish_reason is not None

    @property
    def draft_block_table(self) -> list[int]:
        """The draft model's KV pages (empty without speculation)."""
        spec = self._req.spec
        return list(spec.block_table) if spec is not None else []

    @property
    def draft_computed(self) -> int:
        """Positions with draft K/V (0 without speculation)."""
        spec = self._req.spec
        return spec.computed if spec is not None else 0

    @property
    def speculation(self) -> dict | None:
        """The request's speculation row of the snapshot, or None."""
        spec = self._req.spec
        return spec.describe() if spec is not None else None

    def __eq__(self, other) -> bool:
        return isinstance(other, RequestView) and other._req is self._req

    def __hash__(self) -> int:
        return id(self._req)

    def __repr__(self) -> str:
        return f"RequestView({self.id!r}, {self.status.value}, {self.phase})"
