"""A request's Handoff crossing between local worker processes through shared memory
(issue 43: prefill on one worker, decode on another).

The K/V tensors' bytes go into one POSIX shared-memory segment (`multiprocessing.
shared_memory`: k's bytes, then v's); everything else (token ids, shapes, dtype, the
sampler's RNG state) is small and rides in the JSON message that names the segment
(`handoff_to_wire` / `handoff_from_wire`). One copy out of the exporter's pool into the
segment, one copy from the segment into the importer's pool pages (the dtype converted on the
way): nothing is pickled.

Who owns a segment, so none outlives its request:
- the controller names it (`segment_name`) before the exporter creates it, so it can
  unlink it by name at any moment: a cancel, a dead worker on either side, a stop;
- the exporter creates and fills it, then only closes its mapping;
- the importer copies it out and unlinks it, whether the import works or not;
- `unlink_segment` is idempotent, so two of them racing is harmless.

Python's resource tracker would unlink a segment when the process that created it exits,
behind the owner's back (and warn about a "leak" the owner already handled), so the
exporter's mapping is untracked at once; an attached mapping is forgotten by its unlink.
"""

from __future__ import annotations

import base64
import os
import time
from contextlib import contextmanager
from multiprocessing import resource_tracker, shared_memory

import torch

from minivllm.cache.kv_transfer import KVBlocks, dtype_named
from minivllm.engine.handoff import Handoff

SEGMENT_PREFIX = "minivllm-kv-"


def segment_name(cluster_id: str, request_id: str) -> str:
    """The segment a split request's K/V travels in (at most 255 bytes, no slashes)."""
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in request_id)
    return f"{SEGMENT_PREFIX}{cluster_id}-{safe}"[:200]


def _untrack(shm: shared_memory.SharedMemory) -> None:
    # 3.11's SharedMemory registers every mapping it opens under "/" + name.
    try:
        resource_tracker.unregister("/" + shm.name, "shared_memory")
    except Exception:  # noqa: BLE001 - a tracker that never saw it has nothing to forget
        pass


@contextmanager
def new_segment(name: str, nbytes: int):
    """A new segment `name` of `nbytes`, mapped while the block runs (its buffer is yielded;
    views of it must be gone by the end). It stays after the block, untracked, for its
    reader to unlink; a block that raises unlinks it."""
    shm = shared_memory.SharedMemory(name=name, create=True, size=max(1, nbytes))
    _untrack(shm)
    try:
        yield shm.buf
    except BaseException:
        shm.close()
        unlink_segment(name)
        raise
    shm.close()


def handoff_to_wire(handoff: Handoff, name: str) -> dict:
    """Write `handoff`'s K/V into a new segment `name` and return the message fields that
    describe the rest. The caller releases the request after this."""
    t0 = time.perf_counter()
    kv = handoff.kv.blocks()  # from a pool's pages (PageSpan): one gather on its device
    # From a GPU pool the tensors go straight into the segment: one device-to-host copy,
    # not one into a staging tensor and another into the segment.
    k, v = kv.k.contiguous(), kv.v.contiguous()
    with new_segment(name, k.nbytes + v.nbytes) as buf:
        if k.nbytes:
            flat = torch.frombuffer(buf, dtype=torch.uint8, count=k.nbytes + v.nbytes)
            flat[:k.nbytes].copy_(k.view(-1).view(torch.uint8))
            flat[k.nbytes:].copy_(v.view(-1).view(torch.uint8))
            del flat
    nbytes = k.nbytes + v.nbytes  # the link carries them as they are; B converts on its copy out
    return {**handoff_fields(handoff), "segment": name, "nbytes": nbytes, "link_bytes": nbytes,
            "dtype": str(k.dtype).removeprefix("torch."), "kv_shape": list(k.shape), "model_shape": list(kv.shape),
            "write_ms": (time.perf_counter() - t0) * 1e3}


def handoff_fields(handoff: Handoff) -> dict:
    """A handoff's message fields other than its K/V: tokens and the sampler's RNG state."""
    state = handoff.generator_state
    return {"kv_token_ids": list(handoff.kv.token_ids), "prompt_ids": list(handoff.prompt_ids),
            "output_ids": list(handoff.output_ids),
            "generator_state": None if state is None else base64.b64encode(state.numpy().tobytes()).decode(),
            "generator_device": handoff.generator_device}


def handoff_from_fields(meta: dict, params, kv) -> Handoff:
    """The Handoff whose other fields `handoff_fields` wrote, with K/V `kv`."""
    state = meta.get("generator_state")
    return Handoff(list(meta["prompt_ids"]), list(meta["output_ids"]), params, kv,
                   None if state is None else torch.frombuffer(bytearray(base64.b64decode(state)), dtype=torch.uint8),
                   meta.get("generator_device"))


def handoff_from_wire(meta: dict, params) -> Handoff:
    """The Handoff `meta` describes, its K/V *views* of the segment mapped by torch (Linux:
    /dev/shm), which is unlinked here whatever happens (the importer is its last reader).
    The importer copies the views straight into its pool's pages, converting the dtype on
    the way: no private copy in between. The mapping belongs to the views' storage, so it
    lives exactly as long as the last of them, wherever one ends up (an error's traceback
    included); a mapping closed under a live view would crash the worker."""
    try:
        shape = tuple(meta["kv_shape"])
        dtype = dtype_named(meta["dtype"], "handoff dtype")
        half = meta["nbytes"] // 2
        path = os.path.join(_SHM_DIR, meta["segment"])
        if not half:
            k = v = torch.empty(shape, dtype=dtype)
        elif os.path.exists(path):
            flat = torch.from_file(path, shared=False, size=2 * half, dtype=torch.uint8)  # copy-on-write, only read
            k, v = flat[:half].view(dtype).reshape(shape), flat[half:].view(dtype).reshape(shape)
        else:  # no /dev/shm (not Linux): a private copy, then the mapping closes
            k, v = _copied_out(meta["segment"], half, dtype, shape)
    finally:
        unlink_segment(meta["segment"])
    return handoff_from_fields(meta, params, KVBlocks(list(meta["kv_token_ids"]), k, v, tuple(meta["model_shape"])))


_SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared-memory segments, by name


def _copied_out(name: str, half: int, dtype: torch.dtype, shape: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    shm = shared_memory.SharedMemory(name=name)
    try:
        flat = torch.frombuffer(shm.buf, dtype=torch.uint8, count=2 * half)
        k, v = flat[:half].clone().view(dtype).reshape(shape), flat[half:].clone().view(dtype).reshape(shape)
        del flat
    finally:
        shm.close()
        _unlink(shm)
    return k, v


def _unlink(shm: shared_memory.SharedMemory) -> bool:
    # An attached mapping is tracked; unlink() forgets it, but not when someone else
    # unlinked the segment first.
    try:
        shm.unlink()
    except FileNotFoundError:
        _untrack(shm)
        return False
    return True


def unlink_segment(name: str) -> bool:
    """Remove segment `name` if it exists; True if this call removed it."""
    try:
        shm = shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        return False
    shm.close()
    return _unlink(shm)
