"""The trace recorder: named scopes → Chrome trace JSON (Perfetto) and NVTX ranges.

Usage (the model and the engine call it; the CLI's ``--trace-directory DIR`` turns it on)::

    from minivllm.obs.trace import enable_tracing, trace_scope

    enable_tracing("traces/")                   # once per process; nvtx=None: on iff CUDA
    with trace_scope("step", step_index):
        with trace_scope("model", "decode", tokens=n):
            for i, layer in enumerate(self.layers):
                with trace_scope("layer", i):            # event name "layer 3"
                    with trace_scope("attn"):
                        with trace_scope("qmatmul", "attn_q"):
                            ...
                    with trace_scope("mlp"):
                        ...
        with trace_scope("sample"):
            ...
    # written at exit, or now: flush_trace() -> <dir>/minivllm-trace-<pid>.json

Scope kinds: step, model, layer, attn, mlp, qmatmul, sample, prefill, decode, schedule, draft,
verify, handoff.

Pass the detail as its own argument (an int is fine: ``trace_scope("layer", i)``), never as a
pre-formatted f-string: the event name is formatted only while tracing is on. When tracing is
off, ``trace_scope`` is one global boolean check that returns a shared, pre-built no-op context
manager; nothing is allocated or recorded. Keyword ``args`` still cost the caller a dict per
call, so keep them off the hottest scopes (``layer``, ``attn``, ``mlp``, ``qmatmul``).

The file is Chrome's Trace Event Format: complete events (``"ph": "X"``) with ``ts``/``dur``
in microseconds since this module was imported, plus ``process_name``/``thread_name``
metadata. Open it at https://ui.perfetto.dev or chrome://tracing. One file per process; the
files of several processes (workers, router) can be opened together.

On CUDA each scope is also an NVTX range (Nsight Systems), coloured per scope kind when the
optional ``nvtx`` package is importable; torch's own NVTX bindings take no colour, so without
that package the ranges carry the plain event name.

The recorder below is the one piece of process-global mutable state minivllm allows.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, TypeVar

from minivllm.errors import MinivllmError

__all__ = [
    "SCOPE_KINDS",
    "disable_tracing",
    "enable_tracing",
    "flush_trace",
    "trace_file_path",
    "trace_scope",
    "traced",
    "tracing_enabled",
]

SCOPE_KINDS: frozenset[str] = frozenset(
    {"step", "model", "layer", "attn", "mlp", "qmatmul", "sample", "prefill", "decode", "schedule",
     "draft", "verify",  # speculative decoding's proposal and verification
     "handoff"}  # a split request's K/V leaving this worker ("export") or entering it ("import")
)

# One ARGB colour per kind, so Nsight Systems tells the kinds apart at a glance.
_NVTX_COLORS: dict[str, int] = {
    "draft": 0xFF86BCB6,  # light teal
    "verify": 0xFFD37295,  # rose
    "step": 0xFF4E79A7,  # blue
    "model": 0xFF59A14F,  # green
    "layer": 0xFFB07AA1,  # purple
    "attn": 0xFFE15759,  # red
    "mlp": 0xFFF28E2B,  # orange
    "qmatmul": 0xFFEDC948,  # yellow
    "sample": 0xFF76B7B2,  # teal
    "prefill": 0xFFFF9DA7,  # pink
    "decode": 0xFF9C755F,  # brown
    "schedule": 0xFFBAB0AC,  # grey
    "handoff": 0xFF17BECF,  # cyan
}
_NVTX_DOMAIN = "minivllm"

_T0_NS = time.perf_counter_ns()  # every "ts" is relative to this


def trace_file_path(directory: str | Path, pid: int | None = None) -> Path:
    """Where this process's (or `pid`'s) trace goes inside `directory`."""
    return Path(directory) / f"minivllm-trace-{os.getpid() if pid is None else pid}.json"


def _check_kind(kind: str) -> None:
    if kind not in SCOPE_KINDS:
        raise ValueError(
            f"unknown trace scope kind {kind!r}; allowed kinds: {', '.join(sorted(SCOPE_KINDS))}"
        )


# --- NVTX back ends ------------------------------------------------------------------


class _NvtxPackage:
    """The `nvtx` pip package: coloured thread ranges in the "minivllm" domain."""

    describe = "nvtx package (coloured)"

    def __init__(self, nvtx_module: Any):
        self._push = nvtx_module.push_range
        self._pop = nvtx_module.pop_range

    def start(self, name: str, kind: str) -> None:
        self._push(message=name, color=_NVTX_COLORS[kind], domain=_NVTX_DOMAIN)

    def end(self, handle: Any) -> None:
        self._pop(domain=_NVTX_DOMAIN)


class _TorchNvtxStartEnd:
    """torch.cuda.nvtx range_start/range_end: the handle pairs the end with its own start."""

    describe = "torch.cuda.nvtx range_start/range_end"

    def __init__(self, torch_nvtx: Any):
        self._start = torch_nvtx.range_start
        self.end = torch_nvtx.range_end  # end(handle)

    def start(self, name: str, kind: str) -> int:
        return self._start(name)


class _TorchNvtxPushPop:
    """torch.cuda.nvtx range_push/range_pop, for torch builds without range_start."""

    describe = "torch.cuda.nvtx range_push/range_pop"

    def __init__(self, torch_nvtx: Any):
        self._push = torch_nvtx.range_push
        self._pop = torch_nvtx.range_pop

    def start(self, name: str, kind: str) -> None:
        self._push(name)  # returns the depth; deliberately ignored (see _Scope)

    def end(self, handle: Any) -> None:
        self._pop()


def _probe(backend: Any) -> Any:
    """One real start/end pair, so a back end that cannot work fails here, not mid-run."""
    backend.end(backend.start("minivllm tracing enabled", "step"))
    return backend


def _resolve_nvtx(requested: bool | None) -> Any:
    explicit = requested is not None
    if requested is None:
        import torch

        requested = torch.cuda.is_available()
    if not requested:
        return None
    failures: list[str] = []
    try:
        import nvtx  # optional; the only way to get colours
    except ImportError:
        pass
    else:
        try:
            return _probe(_NvtxPackage(nvtx))
        except Exception as exc:  # noqa: BLE001 - fall through to torch's bindings
            failures.append(f"nvtx package: {exc}")
    import torch.cuda.nvtx as torch_nvtx

    candidates = []
    if hasattr(torch_nvtx, "range_start") and hasattr(torch_nvtx, "range_end"):
        candidates.append(_TorchNvtxStartEnd(torch_nvtx))
    candidates.append(_TorchNvtxPushPop(torch_nvtx))
    for backend in candidates:
        try:
            return _probe(backend)
        except Exception as exc:  # noqa: BLE001 - CPU builds raise RuntimeError/AttributeError
            failures.append(f"{backend.describe}: {exc}")
    message = (
        "NVTX ranges are not available in this process ("
        + "; ".join(failures)
        + "). Use a CUDA build of torch or install the `nvtx` package, "
        "or trace without NVTX (enable_tracing(..., nvtx=False))."
    )
    if explicit:
        raise MinivllmError(message)
    warnings.warn(message + " Tracing continues without NVTX.", RuntimeWarning, stacklevel=3)
    return None


# --- the recorder --------------------------------------------------------------------


class _Session:
    """One recording: where it goes, what it holds, and the NVTX back end (or None)."""

    __slots__ = ("directory", "events", "thread_names", "nvtx", "pid", "process_name")

    def __init__(self, directory: Path, nvtx_backend: Any, process_name: str | None):
        self.directory = directory
        # (name, kind, tid, start_ns, end_ns, args). list.append is atomic under the GIL,
        # so threads append without a lock; flush copies the list before reading it.
        self.events: list[tuple[str, str, int, int, int, dict[str, Any] | None]] = []
        self.thread_names: dict[int, str] = {}
        self.nvtx = nvtx_backend
        self.pid = os.getpid()
        self.process_name = process_name


class _NoopScope:
    """What `trace_scope` returns while tracing is off: one shared instance, no state."""

    __slots__ = ()

    def __enter__(self) -> _NoopScope:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        return None


_NOOP_SCOPE = _NoopScope()


class _Scope:
    """One traced range. Its life is exactly the `with` block.

    The NVTX range starts in __enter__ and ends in __exit__, always and without looking at
    what the NVTX call returned. A range guard built conditionally on a push's return value
    is easy to get wrong: bound to a temporary, it is dropped at once, every range closes
    ~600 ns after it opens and the profile shows nothing. Here nothing but the `with` statement
    decides when a range ends, and __exit__ runs on exceptions too.
    """

    __slots__ = ("_session", "_name", "_kind", "_args", "_tid", "_start_ns", "_handle")

    def __init__(self, session: _Session, kind: str, name: str, args: dict[str, Any] | None):
        self._session = session
        self._kind = kind
        self._name = name
        self._args = args
        self._handle: Any = None

    def __enter__(self) -> _Scope:
        self._tid = threading.get_native_id()
        nvtx_backend = self._session.nvtx
        if nvtx_backend is not None:
            self._handle = nvtx_backend.start(self._name, self._kind)
        self._start_ns = time.perf_counter_ns()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        end_ns = time.perf_counter_ns()
        session = self._session
        if session.nvtx is not None:
            session.nvtx.end(self._handle)
        tid = self._tid
        if tid not in session.thread_names:
            session.thread_names[tid] = threading.current_thread().name
        session.events.append((self._name, self._kind, tid, self._start_ns, end_ns, self._args))
        return None  # never swallow the exception


_lock = threading.Lock()  # guards enable/disable/flush, not the hot path
_enabled = False  # the one boolean trace_scope looks at
_session: _Session | None = None
_atexit_registered = False


def trace_scope(kind: str, detail: Any = "", **args: Any) -> Any:
    """A context manager for one traced range: ``with trace_scope("layer", i): ...``.

    The event is named ``"<kind> <detail>"`` (just ``kind`` when detail is empty), its
    ``cat`` is `kind`, and its ``args`` are `args` plus ``detail``. While tracing is off this
    returns the same shared no-op object every time and checks nothing else (`kind` is
    validated only while tracing is on).
    """
    if not _enabled:
        return _NOOP_SCOPE
    session = _session
    if session is None:  # disabled between the check and here, from another thread
        return _NOOP_SCOPE
    _check_kind(kind)
    if detail is None or detail == "":
        name = kind
        event_args = args or None
    else:
        name = f"{kind} {detail}"
        args["detail"] = detail
        event_args = args
    return _Scope(session, kind, name, event_args)


F = TypeVar("F", bound=Callable[..., Any])


def traced(kind: str, detail: Any = "") -> Callable[[F], F]:
    """Decorator form of `trace_scope` for whole functions (kind checked when decorating)."""
    _check_kind(kind)

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*a: Any, **kw: Any) -> Any:
            if not _enabled:
                return fn(*a, **kw)
            with trace_scope(kind, detail):
                return fn(*a, **kw)

        return wrapper  # type: ignore[return-value]

    return decorate


def tracing_enabled() -> bool:
    """Whether scopes are being recorded now."""
    return _enabled


def enable_tracing(
    directory: str | Path, *, nvtx: bool | None = None, process_name: str | None = None
) -> Path:
    """Start recording scopes; returns the file that `flush_trace` (and exit) will write.

    `nvtx`: also emit NVTX ranges. None means "iff torch.cuda.is_available()"; True on a
    machine without NVTX raises `MinivllmError`. `process_name` labels this process in
    Perfetto (default ``"minivllm <pid>"``). Enabling again into the same directory keeps
    the events recorded so far; into another directory, the old recording is flushed first.
    """
    global _enabled, _session, _atexit_registered
    directory = Path(directory)
    nvtx_backend = _resolve_nvtx(nvtx)
    with _lock:
        old = _session
        if old is not None and old.directory != directory:
            _write(old)
        session = _Session(directory, nvtx_backend, process_name)
        if old is not None and old.directory == directory:
            session.events = old.events
            session.thread_names = old.thread_names
        _session = session
        _enabled = True
        if not _atexit_registered:
            atexit.register(_flush_at_exit)
            _atexit_registered = True
    return trace_file_path(directory, session.pid)


def disable_tracing() -> Path | None:
    """Stop recording, write what was recorded, and forget it. Returns the file written."""
    global _enabled, _session
    with _lock:
        _enabled = False
        session, _session = _session, None
        if session is None:
            return None
        return _write(session)


def flush_trace() -> Path | None:
    """Write everything recorded so far to ``<dir>/minivllm-trace-<pid>.json`` (the whole
    file is rewritten each time). Returns its path, or None when tracing is off."""
    with _lock:
        session = _session
        if session is None:
            return None
        return _write(session)


def _write(session: _Session) -> Path:
    events = list(session.events)  # a snapshot; other threads may keep appending
    pid = session.pid
    trace_events: list[dict[str, Any]] = [
        {
            "ph": "M",
            "name": "process_name",
            "pid": pid,
            "tid": 0,
            "args": {"name": session.process_name or f"minivllm {pid}"},
        }
    ]
    for tid, thread_name in sorted(dict(session.thread_names).items()):
        trace_events.append(
            {
                "ph": "M",
                "name": "thread_name",
                "pid": pid,
                "tid": tid,
                "args": {"name": thread_name},
            }
        )
    for name, kind, tid, start_ns, end_ns, args in events:
        event: dict[str, Any] = {
            "ph": "X",
            "name": name,
            "cat": kind,
            "ts": (start_ns - _T0_NS) / 1000,
            "dur": (end_ns - start_ns) / 1000,
            "pid": pid,
            "tid": tid,
        }
        if args:
            event["args"] = args
        trace_events.append(event)
    path = trace_file_path(session.directory, pid)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        # default=str: args may hold dtypes, devices or other non-JSON values.
        json.dump({"traceEvents": trace_events, "displayTimeUnit": "ms"}, f, default=str)
    os.replace(tmp, path)  # a reader never sees half a file
    return path


def _flush_at_exit() -> None:
    try:
        flush_trace()
    except OSError as exc:
        warnings.warn(f"could not write the minivllm trace at exit: {exc}", RuntimeWarning, stacklevel=2)


def _after_fork_in_child() -> None:
    # A forked child is another process: it gets its own file and none of the parent's events.
    global _session, _lock
    _lock = threading.Lock()  # another thread of the parent may have held it at fork time
    old = _session
    if old is not None:
        _session = _Session(old.directory, old.nvtx, None)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
