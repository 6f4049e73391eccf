"""The trace recorder: Chrome trace JSON that nests, NVTX on CUDA, nothing when off.

The reference is the Chrome Trace Event Format itself: the file must load with `json`, hold
complete ("X") events with microsecond ts/dur, and children must lie inside their parents.
No timed assertions: "free when off" is checked structurally (one shared no-op object,
nothing recorded).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT

from minivllm.errors import MinivllmError
from minivllm.obs import trace
from minivllm.obs.trace import (
    SCOPE_KINDS,
    disable_tracing,
    enable_tracing,
    flush_trace,
    trace_scope,
    traced,
    tracing_enabled,
)

ROUNDING_US = 1.0


@pytest.fixture(autouse=True)
def _tracing_off_after():
    yield
    disable_tracing()


def _load(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _complete(doc: dict) -> list[dict]:
    return [e for e in doc["traceEvents"] if e["ph"] == "X"]


def _by_name(events: list[dict]) -> dict[str, dict]:
    out = {e["name"]: e for e in events}
    assert len(out) == len(events), "event names are not unique in this test"
    return out


def _inside(child: dict, parent: dict) -> bool:
    return (
        parent["ts"] <= child["ts"] + ROUNDING_US
        and child["ts"] + child["dur"] <= parent["ts"] + parent["dur"] + ROUNDING_US
    )


def _run_nested_step() -> None:
    with trace_scope("step", 7):
        with trace_scope("model", "decode", tokens=1):
            with trace_scope("layer", 0):
                with trace_scope("attn"):
                    with trace_scope("qmatmul", "attn_q", n=64, k=32):
                        torch.ones(4, 4) @ torch.ones(4, 4)
        with trace_scope("sample"):
            pass


def test_nested_scopes_write_chrome_trace(tmp_path):
    expected = enable_tracing(tmp_path, nvtx=False)
    assert tracing_enabled()
    _run_nested_step()
    path = flush_trace()
    assert path == expected == tmp_path / f"minivllm-trace-{os.getpid()}.json"
    doc = _load(path)
    assert doc["displayTimeUnit"] == "ms"

    events = _by_name(_complete(doc))
    assert set(events) == {"step 7", "model decode", "layer 0", "attn", "qmatmul attn_q", "sample"}
    for e in events.values():
        assert e["pid"] == os.getpid()
        assert e["tid"] == threading.get_native_id()
        assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float))
        assert e["dur"] >= 0
    assert {n: e["cat"] for n, e in events.items()} == {
        "step 7": "step",
        "model decode": "model",
        "layer 0": "layer",
        "attn": "attn",
        "qmatmul attn_q": "qmatmul",
        "sample": "sample",
    }
    assert events["layer 0"]["args"] == {"detail": 0}
    assert events["qmatmul attn_q"]["args"] == {"detail": "attn_q", "n": 64, "k": 32}
    assert events["model decode"]["args"] == {"detail": "decode", "tokens": 1}
    assert "args" not in events["attn"]

    chain = ["step 7", "model decode", "layer 0", "attn", "qmatmul attn_q"]
    for parent, child in zip(chain, chain[1:]):
        assert _inside(events[child], events[parent]), (parent, child)
    assert _inside(events["sample"], events["step 7"])
    # siblings do not overlap: sample starts after the model scope ends
    model = events["model decode"]
    assert model["ts"] + model["dur"] <= events["sample"]["ts"] + ROUNDING_US

    meta = [e for e in doc["traceEvents"] if e["ph"] == "M"]
    assert {"process_name", "thread_name"} <= {e["name"] for e in meta}
    process = next(e for e in meta if e["name"] == "process_name")
    assert process["pid"] == os.getpid() and process["args"]["name"]


def test_disable_writes_file_and_later_scopes_are_shared_noop(tmp_path):
    enable_tracing(tmp_path, nvtx=False, process_name="worker 0")
    with trace_scope("step", 1):
        pass
    written = disable_tracing()
    assert written is not None and len(_complete(_load(written))) == 1
    assert _load(written)["traceEvents"][0]["args"]["name"] == "worker 0"
    assert not tracing_enabled()
    assert flush_trace() is None

    first = trace_scope("layer", 3)
    assert trace_scope("qmatmul", "ffn_down", n=1) is first
    assert trace_scope("step") is first
    # an invalid kind is not even looked at while off (that check costs only when on)
    assert trace_scope("no-such-kind") is first
    with first as entered:
        assert entered is first
    for i in range(100):
        with trace_scope("layer", i):
            with trace_scope("qmatmul", "attn_q"):
                pass
    assert trace._session is None  # nowhere to record into

    # Nothing from the off period shows up once tracing is on again (fresh directory).
    other = tmp_path / "again"
    enable_tracing(other, nvtx=False)
    assert _complete(_load(flush_trace())) == []


def test_scopes_while_on_are_fresh_objects(tmp_path):
    enable_tracing(tmp_path, nvtx=False)
    a, b = trace_scope("layer", 1), trace_scope("layer", 1)
    assert a is not b and a is not trace._NOOP_SCOPE


def test_invalid_kind_raises_when_on(tmp_path):
    enable_tracing(tmp_path, nvtx=False)
    with pytest.raises(ValueError) as info:
        trace_scope("matmul", "attn_q")
    message = str(info.value)
    assert "'matmul'" in message
    for kind in SCOPE_KINDS:
        assert kind in message
    with pytest.raises(ValueError):
        traced("bogus")


def test_exception_closes_event_and_propagates(tmp_path):
    enable_tracing(tmp_path, nvtx=False)

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with trace_scope("step", 0):
            with trace_scope("sample"):
                raise Boom("inside")
    events = _by_name(_complete(_load(flush_trace())))
    assert set(events) == {"step 0", "sample"}
    assert _inside(events["sample"], events["step 0"])


class _FakeNvtx:
    """Records NVTX calls in order, to check that every start is ended exactly once."""

    describe = "fake"

    def __init__(self):
        self.calls: list[tuple[str, object]] = []
        self._next = 0

    def start(self, name: str, kind: str) -> int:
        self._next += 1
        self.calls.append(("start", (name, kind, self._next)))
        return self._next

    def end(self, handle: object) -> None:
        self.calls.append(("end", handle))


def test_nvtx_ranges_pair_with_scope_even_on_exceptions(tmp_path, monkeypatch):
    fake = _FakeNvtx()
    monkeypatch.setattr(trace, "_resolve_nvtx", lambda requested: fake)
    enable_tracing(tmp_path, nvtx=True)
    with pytest.raises(RuntimeError):
        with trace_scope("layer", 2):
            with trace_scope("mlp"):
                assert fake.calls == [
                    ("start", ("layer 2", "layer", 1)),
                    ("start", ("mlp", "mlp", 2)),
                ]
                raise RuntimeError("x")
    # The inner range ends first, then the outer, each with its own handle, and only at
    # the end of its `with` block (not right after the start, the original's bug).
    assert fake.calls[2:] == [("end", 2), ("end", 1)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only build")
def test_nvtx_requested_without_cuda_is_a_clear_error(tmp_path):
    try:
        import nvtx  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("the nvtx package provides NVTX ranges even without CUDA")
    with pytest.raises(MinivllmError, match="nvtx=False"):
        enable_tracing(tmp_path, nvtx=True)
    assert not tracing_enabled()
    enable_tracing(tmp_path)  # nvtx=None: off without CUDA, no error
    assert trace._session.nvtx is None


def test_threads_get_their_own_tid(tmp_path):
    enable_tracing(tmp_path, nvtx=False)
    tids: dict[str, int] = {}
    barrier = threading.Barrier(2)

    def work(label: str) -> None:
        tids[label] = threading.get_native_id()
        barrier.wait()  # both threads alive at once, so their native ids differ
        with trace_scope("schedule", label):
            with trace_scope("decode", label):
                pass
        barrier.wait()

    threads = [threading.Thread(target=work, args=(x,), name=f"t-{x}") for x in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    doc = _load(flush_trace())
    events = _by_name(_complete(doc))
    assert tids["a"] != tids["b"]
    for label in ("a", "b"):
        assert events[f"schedule {label}"]["tid"] == tids[label]
        assert events[f"decode {label}"]["tid"] == tids[label]
        assert _inside(events[f"decode {label}"], events[f"schedule {label}"])
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert names[tids["a"]] == "t-a" and names[tids["b"]] == "t-b"


def test_traced_decorator(tmp_path):
    @traced("sample", "greedy")
    def pick(x):
        return x + 1

    assert pick(1) == 2  # off: plain call
    enable_tracing(tmp_path, nvtx=False)
    assert pick(2) == 3
    events = _complete(_load(flush_trace()))
    assert [(e["name"], e["cat"]) for e in events] == [("sample greedy", "sample")]


def test_reenable_same_directory_keeps_events(tmp_path):
    enable_tracing(tmp_path, nvtx=False)
    with trace_scope("prefill"):
        pass
    enable_tracing(tmp_path, nvtx=False)
    with trace_scope("decode"):
        pass
    names = [e["name"] for e in _complete(_load(flush_trace()))]
    assert names == ["prefill", "decode"]


@pytest.mark.cuda
def test_nvtx_scopes_on_gpu(tmp_path):
    enable_tracing(tmp_path, nvtx=True)
    assert trace._session.nvtx is not None
    x = torch.randn(256, 256, device="cuda")
    for step in range(3):
        with trace_scope("step", step):
            with trace_scope("layer", 0):
                with trace_scope("qmatmul", "attn_q"):
                    y = x @ x
            with pytest.raises(ZeroDivisionError):
                with trace_scope("sample"):
                    raise ZeroDivisionError
    torch.cuda.synchronize()
    assert y.shape == (256, 256)
    events = _complete(_load(flush_trace()))
    assert len(events) == 12


def test_every_scope_kind_the_code_opens_is_allowed():
    # An unknown kind raises ValueError at run time, and only with tracing on: speculative
    # decoding's "draft"/"verify" scopes once broke `generate --trace-directory --draft-model`.
    import re

    from minivllm.obs.trace import _NVTX_COLORS, SCOPE_KINDS

    root = REPO_ROOT / "minivllm"
    used = {m for f in root.rglob("*.py") for m in re.findall(r'trace_scope\(\s*"([a-z_]+)"', f.read_text())}
    assert used and used <= SCOPE_KINDS, used - SCOPE_KINDS
    assert set(_NVTX_COLORS) == SCOPE_KINDS
