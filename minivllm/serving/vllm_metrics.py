"""Our `/metrics` families again under vLLM's names, so the Grafana dashboards people
already run for vLLM read a minivllm server unchanged.

The same samples, renamed, never observed twice: at scrape time the server's registry is
collected once and each mapped family is emitted again as `vllm:<name>` with vLLM's
`model_name` label added (our `worker` label stays: vLLM's queries sum over the labels
they do not name). One table, `VLLM_NAMES`, says which family becomes which.

Where the meaning differs from vLLM's, the help text says so: our prefix-cache counters
count lookups and lookups that restored pages, vLLM's count tokens.
"""

from __future__ import annotations

from prometheus_client.metrics_core import Metric

# our family -> (vLLM's names for it, labels renamed to vLLM's)
VLLM_NAMES: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "minivllm_time_to_first_token_seconds": (("vllm:time_to_first_token_seconds",), {}),
    # vLLM V1 calls it inter_token_latency; dashboards written for V0 query time_per_output_token
    "minivllm_inter_token_latency_seconds": (("vllm:inter_token_latency_seconds",
                                              "vllm:time_per_output_token_seconds"), {}),
    "minivllm_e2e_request_latency_seconds": (("vllm:e2e_request_latency_seconds",), {}),
    "minivllm_requests": (("vllm:request_success",), {"finish_reason": "finished_reason"}),
    "minivllm_prompt_tokens": (("vllm:prompt_tokens",), {}),
    "minivllm_generation_tokens": (("vllm:generation_tokens",), {}),
    "minivllm_num_requests_running": (("vllm:num_requests_running",), {}),
    "minivllm_num_requests_waiting": (("vllm:num_requests_waiting",), {}),
    # V1's name, and V0's that older dashboards query
    "minivllm_kv_cache_usage_perc": (("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"), {}),
    "minivllm_prefix_cache_queries": (("vllm:prefix_cache_queries",), {}),
    "minivllm_prefix_cache_hits": (("vllm:prefix_cache_hits",), {}),
    "minivllm_spec_decode_num_draft_tokens": (("vllm:spec_decode_num_draft_tokens",), {}),
    "minivllm_spec_decode_num_accepted_tokens": (("vllm:spec_decode_num_accepted_tokens",), {}),
}


def vllm_families(families, model_name: str):
    """The mapped ones of `families` (collected metric families) under vLLM's names, with
    vLLM's `model_name` label first."""
    for family in families:
        names, renames = VLLM_NAMES.get(family.name, ((), {}))
        for name in names:
            out = Metric(name, f"{family.documentation} (minivllm's {family.name}, under vLLM's name)",
                         family.type, family.unit)
            for s in family.samples:
                labels = {renames.get(k, k): v for k, v in s.labels.items()}
                out.add_sample(name + s.name[len(family.name):], {"model_name": model_name, **labels},
                               s.value, s.timestamp, s.exemplar)
            yield out
