"""A request moving between engines mid-flight: prefill on one, decode on another (issue 43).

    handoff = engine_a.export_request(rid)        # tokens so far, full pages' K/V, sampler state
    engine_a.abort(rid)                           # (the caller decides when A lets go)
    rid_b = engine_b.import_request(handoff)      # pages into B's prefix cache, then a request

On B the request is a new one whose prompt is everything A had (prompt and generated
tokens) and whose budget is what A left. B's admission restores the imported pages from
its prefix cache (kv_transfer.py) and computes only the tail past the last full page, so
B continues exactly where A stopped: in batch-invariant mode, token for token what one
engine would have produced (tests/integration/engine/test_handoff.py).

Carried: the tokens, the K/V of every computed full page, the sampling parameters and the
sampler's RNG state (seeded sampling continues its stream; a CPU generator's state goes
to a CPU engine only, a CUDA one to a CUDA engine). Not yet carried: a constraint's matcher
state, the stop-string matcher's pending text, and presence/frequency penalties' view of
A's output (B counts those tokens as prompt).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from minivllm.cache.kv_transfer import KVBlocks, LandedBlocks, PageSpan
from minivllm.errors import ConfigError
from minivllm.sampling.sampling_params import SamplingParams


@dataclass
class Handoff:
    prompt_ids: list[int]
    output_ids: list[int]
    params: SamplingParams
    kv: KVBlocks | PageSpan | LandedBlocks  # copied out / still in the exporter's pool / written into ours
    generator_state: torch.Tensor | None  # torch.Generator.get_state(), or None for greedy
    generator_device: str | None

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes


def export_request(req, pool, *, copy: bool = True) -> Handoff:
    """`req`'s state for another engine: it must have its first token (decode), and its
    K/V of every full computed page, copied out (`copy=False`: a `PageSpan` of the pool's
    pages, valid only while the request holds them)."""
    if req.finish_reason is not None:
        raise ConfigError("request", req.id, f"has finished ({req.finish_reason}): export a request still running")
    if not req.output_ids:
        raise ConfigError("request", req.id, "has no token yet: export it once its prefill is done")
    if req.params.structured is not None:
        raise ConfigError("request", req.id, "is constrained: moving a constraint's matcher is not supported yet")
    full = (min(req.num_computed, req.num_tokens - 1) // pool.page_size) * pool.page_size
    span = PageSpan(pool, list(req.block_table[:full // pool.page_size]), req.all_ids[:full])
    kv = span.blocks() if copy else span
    gen = req.generator
    return Handoff(list(req.prompt_ids), list(req.output_ids), req.params, kv,
                   gen.get_state() if gen is not None else None, gen.device.type if gen is not None else None)


def continuation(handoff: Handoff) -> tuple[list[int], SamplingParams]:
    """The prompt and parameters of the request that continues `handoff` on another engine."""
    left = handoff.params.max_tokens - len(handoff.output_ids)
    if left < 1:
        raise ConfigError("handoff", f"{len(handoff.output_ids)} tokens generated",
                          f"max_tokens={handoff.params.max_tokens} leaves nothing to continue")
    params = dataclasses.replace(handoff.params, max_tokens=left)
    return handoff.prompt_ids + handoff.output_ids, params


def restore_generator(req, handoff: Handoff) -> None:
    """Continue the exporter's RNG stream, where the devices match."""
    if handoff.generator_state is None or req.generator is None:
        return
    if req.generator.device.type != handoff.generator_device:
        raise ConfigError("handoff", f"a {handoff.generator_device} sampler state",
                          f"this engine samples on {req.generator.device.type}: continue greedy or seeded "
                          f"requests only between engines of one device kind")
    req.generator.set_state(handoff.generator_state)
