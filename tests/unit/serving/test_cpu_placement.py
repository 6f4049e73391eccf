"""`Cluster(pin_cpus=True)`'s plan (serving/cpu_placement.py): CPU workers get as many CPUs
as threads, one per physical core first; GPU workers share the rest. Topologies are given
by hand, so each expected set is worked out independently of the code."""

from __future__ import annotations

import pytest

from minivllm.errors import ConfigError
from minivllm.serving.cpu_placement import cpus_physical_first, plan_cpus
from minivllm.serving.inference_devices import parse_inference_devices


def pairs(cpu: int) -> str:  # 4 cores, hyperthreads numbered side by side: (0, 1), (2, 3), ...
    return f"{cpu // 2 * 2},{cpu // 2 * 2 + 1}"


def halves(cpu: int) -> str:  # 4 cores, second hyperthreads numbered after the first: (0, 4), (1, 5), ...
    return f"{cpu % 4},{cpu % 4 + 4}"


def test_each_physical_core_comes_once_before_any_comes_twice():
    assert cpus_physical_first(range(8), pairs) == [0, 2, 4, 6, 1, 3, 5, 7]
    assert cpus_physical_first(range(8), halves) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert cpus_physical_first([1, 2, 3, 5], pairs) == [1, 2, 5, 3]  # a container's subset: 3 is 2's sibling
    assert cpus_physical_first([0, 1, 2], str) == [0, 1, 2]  # no topology: every CPU its own core


def test_cpu_workers_get_their_threads_worth_and_gpu_workers_the_rest():
    devices = parse_inference_devices(["cuda:0", "cpu:3", "cpu:2"], cuda_count=1, cpu_cores=8)
    plan = {d.name: d.cpus for d in plan_cpus(devices, cpus_physical_first(range(8), pairs))}
    assert plan == {"cpu": (0, 2, 4), "cpu#2": (1, 6), "cuda:0": (3, 5, 7)}
    assert [d.as_dict()["cpus"] for d in plan_cpus(devices, cpus_physical_first(range(8), pairs))] == [
        [3, 5, 7], [0, 2, 4], [1, 6]]


def test_gpu_workers_share_every_cpu_when_the_cpu_workers_take_them_all():
    devices = parse_inference_devices(["cpu:2", "gpu"], cuda_count=1, cpu_cores=2)
    assert [d.cpus for d in plan_cpus(devices, [0, 1])] == [(0, 1), (0, 1)]


def test_more_threads_than_cpus_and_the_ray_backend_are_refused():
    devices = parse_inference_devices(["cpu:3", "cpu:2"], cpu_cores=4)
    with pytest.raises(ConfigError, match=r"pin_cpus.*5 threads.*4 CPUs"):
        plan_cpus(devices, [0, 1, 2, 3])
    with pytest.raises(ConfigError, match="Ray"):
        plan_cpus(parse_inference_devices(["cpu:1"], backend="ray"), [0, 1], backend="ray")
