"""A split request's K/V through shared memory (serving/kv_segment.py), on its own: the
bytes that come out are the bytes that went in (compared against the tensors written),
the segment's name is gone as soon as the importer has mapped it, and a view of the
mapped K/V that outlives everything (as one held by an error's traceback would) still
reads the right bytes: the mapping lives with its views, never closed under one."""

from __future__ import annotations

import os
import uuid

import pytest
import torch

from minivllm.cache.kv_transfer import KVBlocks
from minivllm.engine.handoff import Handoff
from minivllm.sampling.sampling_params import SamplingParams
from minivllm.serving.kv_segment import SEGMENT_PREFIX, handoff_from_wire, handoff_to_wire


def _handoff(dtype=torch.float16, tokens=32) -> Handoff:
    g = torch.Generator().manual_seed(5)
    shape = (3, tokens, 2, 8)  # layers, tokens, KV heads, head dim
    k, v = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
    kv = KVBlocks(list(range(tokens)), k, v, (3, 2, 8))
    return Handoff(list(range(tokens + 3)), [7], SamplingParams(temperature=0.0, max_tokens=4), kv, None, None)


def _name() -> str:
    return f"{SEGMENT_PREFIX}test-{uuid.uuid4().hex[:12]}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
def test_round_trip_gives_the_same_bytes_and_unlinks(dtype):
    sent, name = _handoff(dtype), _name()
    meta = handoff_to_wire(sent, name)
    assert os.path.exists(f"/dev/shm/{name}") and meta["nbytes"] == sent.kv.nbytes
    got = handoff_from_wire(meta, sent.params)
    assert not os.path.exists(f"/dev/shm/{name}")  # unlinked once mapped
    assert got.kv.k.dtype == dtype and got.kv.token_ids == sent.kv.token_ids
    assert torch.equal(got.kv.k, sent.kv.k) and torch.equal(got.kv.v, sent.kv.v)
    assert (got.prompt_ids, got.output_ids) == (sent.prompt_ids, sent.output_ids)
    pool_page = torch.empty(sent.kv.k.shape, dtype=torch.float32)
    pool_page.copy_(got.kv.k)  # what an f32 importer's page write does: converted on the way
    assert torch.equal(pool_page, sent.kv.k.float())


def test_a_view_that_outlives_the_import_still_reads_its_bytes():
    sent, name = _handoff(), _name()
    kept = handoff_from_wire(handoff_to_wire(sent, name), sent.params).kv.v[2]  # the rest of it is gone
    import gc

    gc.collect()
    other = handoff_to_wire(_handoff(torch.float32), _name())  # new segments may reuse the memory
    assert torch.equal(kept, sent.kv.v[2])
    handoff_from_wire(other, sent.params)


def test_empty_kv_needs_no_bytes():
    sent, name = _handoff(tokens=0), _name()
    got = handoff_from_wire(handoff_to_wire(sent, name), sent.params)
    assert got.kv.k.shape == (3, 0, 2, 8)
    assert not os.path.exists(f"/dev/shm/{name}")


def test_a_missing_segment_is_an_error_not_a_crash():
    sent, name = _handoff(), _name()
    meta = handoff_to_wire(sent, name)
    os.unlink(f"/dev/shm/{name}")  # cancelled meanwhile: the controller unlinked it
    with pytest.raises(FileNotFoundError):
        handoff_from_wire(meta, sent.params)
