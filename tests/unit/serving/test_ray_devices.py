"""The Ray backend's device entries and node lookup (no Ray cluster needed).

Reference: the grammar in inference_devices.py's docstring, and a node table in the
shape `ray.nodes()` returns (the fields this code reads: NodeID, NodeManagerAddress, Resources).
"""

from __future__ import annotations

import pytest

from minivllm.errors import ConfigError
from minivllm.serving.inference_devices import parse_inference_devices
from minivllm.serving.ray_transport import Resources, find_node, resources_of

NODES = [{"NodeID": "a1b2c3d4e5f60000", "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 4.0}},
         {"NodeID": "ffee00112233aaaa", "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 8.0, "GPU": 2.0}},
         {"NodeID": "ffee9988776655bb", "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 1.0}}]


def test_ray_entries_ask_for_resources_and_name_workers_uniquely():
    devices = parse_inference_devices(
        ["cpu", "cpu:4", "gpu", "node=10.0.0.2:gpu", "node=a1b2c3d4:cpu:2"], backend="ray"
    )
    assert [d.name for d in devices] == ["cpu", "cpu#2", "gpu", "gpu#2", "cpu#3"]
    assert [d.threads for d in devices if d.kind == "cpu"] == [1, 4, 2]
    assert [d.node for d in devices] == [None, None, None, "10.0.0.2", "a1b2c3d4"]
    # Inside its actor a GPU worker sees only the GPU Ray assigned, as cuda:0.
    assert {d.torch_device for d in devices if d.kind == "cuda"} == {"cuda:0"}
    assert [resources_of(d) for d in devices] == [Resources(1, 0), Resources(4, 0), Resources(1, 1), Resources(1, 1),
                                                 Resources(2, 0)]


@pytest.mark.parametrize(
    "entry, message",
    [
        ("cuda:1", "Ray assigns"),
        ("node=:cpu", "node=ADDR:ENTRY"),
        ("node=10.0.0.1", "node=ADDR:ENTRY"),
        ("node=10.0.0.1:tpu", "expected cpu"),
    ],
)
def test_bad_ray_entries_name_the_entry(entry, message):
    with pytest.raises(ConfigError, match=message):
        parse_inference_devices([entry], backend="ray")


def test_node_entries_need_the_ray_backend():
    with pytest.raises(ConfigError, match="backend='ray'"):
        parse_inference_devices(["node=10.0.0.1:cpu"])


def test_nodes_are_found_by_ip_or_id_prefix_and_ambiguity_is_refused():
    assert find_node("10.0.0.1", NODES)["NodeID"] == "a1b2c3d4e5f60000"
    assert find_node("FFEE9988", NODES)["NodeManagerAddress"] == "10.0.0.2"
    with pytest.raises(ConfigError, match="2 nodes share that address"):
        find_node("10.0.0.2", NODES)
    with pytest.raises(ConfigError, match="no alive Ray node"):
        find_node("10.0.0.9", NODES)
    with pytest.raises(ConfigError, match="no alive Ray node"):
        find_node("a1b2", NODES)  # too short to be an id prefix
    assert Resources(8, 2).fits(NODES[1]) and not Resources(2, 1).fits(NODES[0])
