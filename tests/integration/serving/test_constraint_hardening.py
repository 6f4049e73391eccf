"""Crafted constraints against a live server (issue 39): each shape that segfaulted the
controller (llguidance overflowing its stack) or stalled it, and deep client JSON, gets a
400 naming the limit, and the server and its worker keep serving.

The server runs in a child process (`minivllm serve`): without the bounds these shapes
kill the process that compiles them, and that must not be pytest.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from minivllm.reliability.hostile_constraints import (
    deep_json_text,
    gbnf_alternatives,
    gbnf_chain,
    lark_chain,
    ref_objects,
    ref_plain,
    schema_format,
)
from minivllm.sampling.constraint_limits import (
    MAX_CHOICES,
    MAX_CONSTRAINT_BYTES,
    MAX_JSON_DEPTH,
    MAX_RULE_DEPTH,
    MAX_SCHEMA_DEPTH,
)

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def server(smollm2_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen([sys.executable, "-m", "minivllm", "serve", "--model", str(smollm2_path),
                             "--inference-device", "cpu:1", "--port", str(port), "--max-model-len", "256",
                             "--max-request-bytes", str(4 << 20)], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, "the server exited while starting"
        try:
            if httpx.get(url + "/health", timeout=2).json().get("status") == "ok":
                break
        except (httpx.HTTPError, ValueError):
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.5)
    pid = httpx.get(url + "/health", timeout=5).json()
    yield url, proc
    try:
        assert proc.poll() is None, f"the server died (exit {proc.returncode})"
        assert httpx.get(url + "/health", timeout=5).json() == pid  # same worker, still ready
        ok = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200, ok.text
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def post(url: str, body: dict | str) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(url + "/v1/chat/completions", content=content, headers={"content-type": "application/json"},
                      timeout=60)


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize("extra, param, limit", [
    (schema_format(ref_objects(1000)), "response_format.json_schema.schema", MAX_SCHEMA_DEPTH),  # 94 KB: segfault
    (schema_format(ref_plain(3000)), "response_format.json_schema.schema", MAX_SCHEMA_DEPTH),  # segfault
    ({"guided_json": ref_plain(6000)}, "guided_json", MAX_SCHEMA_DEPTH),
    ({"guided_grammar": lark_chain(2800)}, "guided_grammar", MAX_RULE_DEPTH),  # segfault
    ({"guided_grammar": gbnf_chain(4000)}, "guided_grammar", MAX_RULE_DEPTH),  # segfault
    ({"guided_grammar": gbnf_chain(8000)}, "guided_grammar", MAX_CONSTRAINT_BYTES),  # 151 KB
    ({"structured_outputs": {"grammar": "start: x\nx: %json " + json.dumps(ref_objects(1000))}},
     "structured_outputs.grammar", MAX_SCHEMA_DEPTH),
    ({"guided_grammar": gbnf_alternatives(30_000)}, "guided_grammar",
     MAX_CONSTRAINT_BYTES),  # stalled workers
    ({"guided_choice": [f"option {i}" for i in range(100_000)]}, "guided_choice", MAX_CHOICES),  # 19.6 s
    ({"guided_json": deep_json_text(100_000)}, "guided_json", MAX_JSON_DEPTH),  # was a 500
    ({"structured_outputs": {"json": deep_json_text(100_000)}}, "structured_outputs.json", MAX_JSON_DEPTH),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": ref_plain(3000)}}],
      "tool_choice": "required"}, "tools[0].function.parameters", MAX_SCHEMA_DEPTH),
], ids=["ref-objects-1000", "ref-plain-3000", "ref-plain-6000", "lark-2800", "gbnf-4000", "gbnf-8000", "lark-%json",
        "gbnf-290KB", "choice-100k", "guided-json-deep", "structured-outputs-deep", "tool-ref-3000"])
def test_crafted_constraints_are_a_400_naming_the_limit(server, extra, param, limit):
    url, proc = server
    r = post(url, {**CHAT, **extra})
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == param and f"the limit is {limit}" in err["message"], err
    assert len(r.content) < 1000  # the value is named by its size, not echoed
    assert proc.poll() is None


def test_deep_json_in_a_tool_calls_arguments_is_a_400(server):
    url, _ = server
    r = post(url, {"max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 100_000 + "]" * 100_000}}]}]})
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == "messages[1].tool_calls[0].function.arguments", err
    assert f"the limit is {MAX_JSON_DEPTH}" in err["message"]


@pytest.mark.parametrize("levels", [490, 100_000])
def test_a_deeply_nested_body_is_called_deep_not_invalid(server, levels):
    """Valid JSON nested past the parser's reach (100,000) or past the limit (490 schema
    levels, ~980 of JSON) is not called "not valid JSON"."""
    url, _ = server
    schema = "{}"
    inner = '{"type": "object", "properties": {"x": ' * levels + schema + "}}" * levels
    r = post(url, json.dumps(CHAT)[:-1] + ', "guided_json": ' + inner + "}")
    assert r.status_code == 400, r.text[:300]
    message = r.json()["error"]["message"]
    assert "not valid JSON" not in message and str(MAX_JSON_DEPTH) in message and "deep" in message, message
