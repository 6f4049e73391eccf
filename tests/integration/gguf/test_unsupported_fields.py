"""Fields the server cannot honour yet are refused with a 400 that names them, never ignored.

`response_format` (structured output) and `tools` / `tool_choice` (tool calls): the request is
refused while its body is translated, before routing, so the cluster is real but needs no
running worker.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient

from minivllm.serving import Cluster
from minivllm.serving.http_api import create_app

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}
CHAT = {"messages": [{"role": "user", "content": "What is the weather?"}], "max_tokens": 4}
COMPLETION = {"prompt": "The weather is", "max_tokens": 4}


@pytest.fixture(scope="module")
def client(smollm2_path):
    return TestClient(create_app(Cluster(str(smollm2_path), ["cpu:1"])))


@pytest.mark.parametrize("route, body, field", [
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ("/v1/completions", {**COMPLETION, "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL]}, "tools"),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL], "tool_choice": "auto"}, "tools"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice"),
])
def test_unsupported_fields_get_a_400_naming_them(client, route, body, field):
    r = client.post(route, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"] and "not supported" in err["message"]


def test_plain_text_format_and_no_tools_are_accepted():
    from minivllm.serving.openai_schema import ChatCompletionRequest

    body = ChatCompletionRequest(**CHAT, response_format={"type": "text"}, tools=[], tool_choice="none")
    assert body.sampling_params(256).max_tokens == 4
