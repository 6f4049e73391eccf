"""One home for the request checks (engine/request_checks.py): the rule each caller used
to keep its own copy of.

Reference: the rules as the issue states them, by hand — a bool is not a token id (in
Python `isinstance(True, int)` holds, so it must be refused by name), the prompt must be
shorter than max_model_len, and OpenAI's stricter rule (prompt + max_tokens fits) only
where asked (`whole_output_fits`, Cluster and the HTTP API).
"""

from __future__ import annotations

import pytest

from minivllm.engine.llm import LLM
from minivllm.engine.request_checks import check_prompt, is_token_ids
from minivllm.errors import ConfigError
from minivllm.sampling.sampling_params import SamplingParams
from minivllm.serving.cluster import Cluster


def test_token_id_lists():
    assert is_token_ids([1, 2, 3]) and is_token_ids((5,)) and is_token_ids([])
    assert not is_token_ids([1, True]) and not is_token_ids([1.0]) and not is_token_ids("12")


@pytest.mark.parametrize("prompt", [[True, 5], [3, False]])
def test_llm_and_cluster_refuse_bool_token_ids_alike(prompt):
    llm, cluster = object.__new__(LLM), object.__new__(Cluster)
    with pytest.raises(ConfigError) as from_llm:
        llm._prompt_ids(prompt)
    with pytest.raises(ConfigError) as from_cluster:
        cluster.encode(prompt)
    assert from_llm.value.field == from_cluster.value.field == "prompt"
    with pytest.raises(ConfigError, match="prompt_token_ids"):
        check_prompt(prompt, SamplingParams(), vocab=10, max_model_len=None)


def test_the_openai_rule_is_a_flag():
    params = SamplingParams(max_tokens=10)
    check_prompt([1] * 5, params, vocab=10, max_model_len=12)  # the engine stops at the context: fine
    with pytest.raises(ConfigError, match="at most 7 more fit") as info:
        check_prompt([1] * 5, params, vocab=10, max_model_len=12, whole_output_fits=True)
    assert info.value.field == "max_tokens"
    with pytest.raises(ConfigError, match="shorter than max_model_len=5"):
        check_prompt([1] * 5, params, vocab=10, max_model_len=5)
    with pytest.raises(ConfigError, match="stop_token_ids"):
        check_prompt([1], SamplingParams(stop_token_ids=[10]), vocab=10, max_model_len=None)
    check_prompt([1, 99], params, vocab=None, max_model_len=None)  # limits not known yet: skipped
