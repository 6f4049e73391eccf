"""Serving: one worker process per device, a router in front, an OpenAI-compatible API.

    with Cluster(model="smollm2-135m", devices=["cpu", "cpu"], router="cost") as cluster:
        for event in cluster.submit("Once upon a time", SamplingParams(max_tokens=32)):
            print(event.text, end="")

The HTTP server (`minivllm serve`) is a thin layer over the same `Cluster`.
"""

from minivllm.serving.cluster import Cluster, RequestStream
from minivllm.serving.inference_devices import InferenceDevice, parse_inference_devices
from minivllm.serving.router import ROUTER_POLICIES

__all__ = ["Cluster", "RequestStream", "InferenceDevice", "parse_inference_devices", "ROUTER_POLICIES"]
