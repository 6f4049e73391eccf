"""logit_bias over the OpenAI-compatible API: applied, and refused out of range.

One real worker (SmolLM2-135M, one CPU thread) behind the background server. Biased texts
are compared with the in-process `LLM` given the same bias as a `SamplingParams` (greedy,
batch-invariant on both sides), and the bias is checked to matter: the biased text differs
from the unbiased one and contains none of the banned tokens. Refusals are 400s whose
`param` and message name the field and the allowed range, as OpenAI's are.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from minivllm.engine.llm import LLM
from minivllm.sampling.sampling_params import SamplingParams
from minivllm.serving import Cluster
from minivllm.serving.http_server import start_server_in_background

KEY = "bias-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
OPTIONS = {"max_model_len": 256, "batch_invariant": True}
PROMPT = "The three most useful things to know about GPUs are"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def server(smollm2_path):
    cluster = Cluster(str(smollm2_path), ["cpu:1"], calibrate=False, **OPTIONS).start()
    srv = start_server_in_background(cluster, api_key=KEY)
    yield srv, cluster
    srv.stop()
    cluster.stop()


@pytest.fixture(scope="module")
def reference(smollm2_path):
    return LLM(str(smollm2_path), progress=False, **OPTIONS)


@pytest.fixture(scope="module")
def client(server):
    srv, _ = server
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_completion_bias_is_applied(server, client, reference):
    _, cluster = server
    plain = reference.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    bias = {str(t): -100 for t in set(plain.token_ids[:4])}
    want = reference.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                     logit_bias=bias))[0]
    assert not set(want.token_ids) & set(plain.token_ids[:4]) and want.text != plain.text
    r = client.completions.create(model=cluster.model_name, prompt=PROMPT, max_tokens=12, temperature=0,
                                  logit_bias=bias, extra_body={"ignore_eos": True})
    assert r.choices[0].text == want.text


def test_chat_bias_is_applied(server, client, reference):
    _, cluster = server
    messages = [{"role": "user", "content": "Name a fruit."}]
    plain = reference.chat(messages, SamplingParams(temperature=0, max_tokens=10))
    favourite = reference.tokenizer.encode(" banana")[0]
    bias = {str(plain.token_ids[0]): -100, str(favourite): 12}
    want = reference.chat(messages, SamplingParams(temperature=0, max_tokens=10, logit_bias=bias))
    assert want.text != plain.text and plain.token_ids[0] not in want.token_ids
    r = client.chat.completions.create(model=cluster.model_name, messages=messages, max_tokens=10, temperature=0,
                                       logit_bias=bias)
    assert r.choices[0].message.content == want.text


@pytest.mark.parametrize("bias, param, says", [
    ({"5": 100.5}, "logit_bias[5]", "[-100, 100]"),
    ({"5": -1000}, "logit_bias[5]", "[-100, 100]"),
    ({"49152": 1}, "logit_bias", "[0, 49152)"),
    ({"99999999999": 1}, "logit_bias", "[0, 49152)"),
    ({"-1": 1}, "logit_bias", "token ids"),
    ({"hello": 1}, "logit_bias", "token ids"),
    ({str(i): 1 for i in range(301)}, "logit_bias", "at most 300"),
    ({"5": "big"}, "logit_bias.5", "number"),
    ([5], "logit_bias", "dictionary"),
])
@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_bad_logit_bias_is_a_400_naming_the_field_and_range(server, route, bias, param, says):
    srv, _ = server
    body = {"prompt": "x"} if route == "completions" else {"messages": [{"role": "user", "content": "x"}]}
    r = httpx.post(f"{srv.url}/v1/{route}", json={**body, "max_tokens": 2, "logit_bias": bias}, headers=AUTH,
                   timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert "logit_bias" in err["message"] and says in err["message"], err
    assert len(r.content) < 2000  # the 301-entry body is not echoed back
