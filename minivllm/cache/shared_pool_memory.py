"""A CPU KV pool in memory another local process can map (issue 43: the prefill worker of a
split request writes its K/V straight into the decode worker's reserved pages, one copy,
instead of into a segment that the decode worker then copies again).

The pool's K and V live in one anonymous memory file (`memfd_create`). It has no name in
any file system, so nothing can outlive the process: no segment to unlink after a crash,
no `/dev/shm` size limit (a container's is often 64 MiB). Another process of the same user
maps it through `/proc/<pid>/fd/<fd>` while the owner lives; the memory is freed when the
owner and every mapping are gone. The whole file is allocated up front (`posix_fallocate`),
so a machine short of memory refuses the pool at start-up instead of killing the worker
with SIGBUS at the first page it touches.

`attach` maps a pool described by `describe` in the exporting process, once per pool,
and on a CUDA exporter registers it with the driver (`cudaHostRegister`, mapped), so the
device's copies into it are DMA, as fast as into pinned memory, and its kernels may store
into it directly. A mapping whose owner is gone (or
whose pid now names another process) is dropped at the next `attach`.
"""

from __future__ import annotations

import os
import threading

import torch

from minivllm.cache.kv_transfer import dtype_named
from minivllm.errors import ConfigError


class SharedPoolMemory:
    """The owner's side: K and V tensors of `shape` in one memory file."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype):
        numel = 1
        for n in shape:
            numel *= n
        elem = torch.empty((), dtype=dtype).element_size()
        self.nbytes = 2 * numel * elem
        self.fd = os.memfd_create("minivllm-kv-pool", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, max(1, self.nbytes))
            os.posix_fallocate(self.fd, 0, max(1, self.nbytes))
            flat = torch.from_file(f"/proc/self/fd/{self.fd}", shared=True, size=2 * numel, dtype=dtype)
        except OSError as exc:
            os.close(self.fd)
            raise ConfigError("kv_shareable", True, f"a shared KV pool of {self.nbytes / 2**20:.0f} MiB could not be "
                                                    f"allocated ({exc}): lower kv_memory_bytes or set "
                                                    f"kv_shareable=False") from exc
        self.k, self.v = flat[:numel].view(shape), flat[numel:].view(shape)
        self.shape, self.dtype = tuple(shape), dtype
        self.inode = os.fstat(self.fd).st_ino

    def describe(self) -> dict:
        """What another local process needs to map this pool (JSON-safe)."""
        return {"pid": os.getpid(), "fd": self.fd, "inode": self.inode, "shape": list(self.shape),
                "dtype": str(self.dtype).removeprefix("torch."), "nbytes": self.nbytes}

    def close(self) -> None:
        # The tensors keep their own mapping; closing the descriptor only ends others' access.
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass


HOST_REGISTER_MAPPED = 2  # cudaHostRegisterMapped


class _Attached:
    def __init__(self, desc: dict, device: torch.device):
        shape, dtype = tuple(desc["shape"]), dtype_named(desc["dtype"], "shared KV pool dtype")
        numel = desc["nbytes"] // 2 // torch.empty((), dtype=dtype).element_size()
        path = _path(desc)
        self.key = _key(desc)
        self.flat = torch.from_file(path, shared=True, size=2 * numel, dtype=dtype)
        self.k, self.v = self.flat[:numel].view(shape), self.flat[numel:].view(shape)
        self.registered = False
        if device.type == "cuda":
            # Mapped: the device may also store into it itself (kernels/triton/kv_export.py)
            err = torch.cuda.cudart().cudaHostRegister(self.flat.data_ptr(), self.flat.nbytes, HOST_REGISTER_MAPPED)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of a {self.flat.nbytes / 2**20:.0f} MiB shared KV pool failed "
                                   f"(error {int(err)})")
            self.registered = True

    def drop(self) -> None:
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.flat.data_ptr())
            self.registered = False
        self.flat = self.k = self.v = None


_attached: dict[tuple, _Attached] = {}
_prefetching: set[tuple] = set()
_lock = threading.Lock()


def attach(desc: dict, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The (k, v) tensors of the pool `desc` describes, mapped in this process (cached), and
    registered for DMA when `device` is a GPU. Raises OSError if the owner is gone."""
    device = torch.device(device)
    with _lock:
        for key in [k for k, a in _attached.items() if not _alive(a.key)]:
            _attached.pop(key).drop()  # its owner is gone: let its memory go
        key = _key(desc)
        if not _alive(key):
            raise FileNotFoundError(f"shared KV pool of pid {desc['pid']} is gone")
        entry = _attached.get(key)
        if entry is None:
            entry = _attached[key] = _Attached(desc, device)
        return entry.k, entry.v


def prefetch(desc: dict, device: torch.device | str = "cpu") -> None:
    """Start mapping (and, for a GPU, host-registering) the pool `desc` describes in a
    background thread, once per pool, so the first write into it does not wait for the
    registration (pinning a pool of gigabytes takes a good part of a second). Errors are
    left for `attach`, which the writer calls anyway, to raise where they are handled."""
    key = _key(desc)
    with _lock:
        if key in _attached or key in _prefetching:
            return
        _prefetching.add(key)

    def run() -> None:
        try:
            attach(desc, device)
        except Exception:  # noqa: BLE001 - the writer's own attach raises it again, where it is handled
            pass
        finally:
            with _lock:
                _prefetching.discard(key)

    threading.Thread(target=run, name="kv-pool-prefetch", daemon=True).start()


def detach(desc: dict) -> None:
    """Drop this process's mapping of the pool `desc` describes (a no-op if none)."""
    with _lock:
        entry = _attached.pop(_key(desc), None)
    if entry is not None:
        entry.drop()


def forget_all() -> None:
    """Drop every mapping (tests; a process about to exit)."""
    with _lock:
        while _attached:
            _attached.popitem()[1].drop()


def _path(desc: dict) -> str:
    return f"/proc/{int(desc['pid'])}/fd/{int(desc['fd'])}"


def _key(desc: dict) -> tuple:
    return (int(desc["pid"]), int(desc["fd"]), int(desc["inode"]))


def _alive(key: tuple) -> bool:
    pid, fd, inode = key
    try:
        return os.stat(f"/proc/{pid}/fd/{fd}").st_ino == inode
    except OSError:
        return False
