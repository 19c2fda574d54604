"""Topology presets expand into the Node objects the harness creates (no cluster needed)."""

from __future__ import annotations

import ipaddress

import pytest
from pydantic import ValidationError

from pdserve_dev.cluster.topology import (
    GPU_RESOURCE,
    RACK_LABEL,
    RDMA_RESOURCE,
    ZONE_LABEL,
    NodePool,
    Rack,
    Zone,
    get_topology,
    grid,
)


def test_default_topology_has_every_gpu_product_the_examples_name_and_cpu_nodes() -> None:
    nodes = get_topology("default").nodes()
    gpu = [n for n in nodes if n.pool.gpus > 0]
    assert len(gpu) == 24 and all(n.pool.gpus == 8 for n in gpu)
    assert {n.zone for n in nodes} == {"zone-a", "zone-b"}
    assert {n.rack for n in gpu} == {f"zone-{z}-rack-{r}" for z in "ab" for r in (1, 2, 3)}
    products = {n.rack: n.pool.gpu_product for n in gpu}
    assert products["zone-a-rack-3"] == "NVIDIA-H200" and products["zone-b-rack-3"] == "NVIDIA-GB200"
    assert sum(p == "NVIDIA-H100-80GB-HBM3" for p in products.values()) == 4
    without_rdma = sorted(n.name for n in nodes if not n.has_rdma and n.pool.gpus)
    assert without_rdma == [f"gpu-zone-b-rack-2-{i}" for i in range(4)]
    # The GB200 rack is one NVLink domain (examples/pvc-heterogeneous-tp.yaml needs 10 GPUs in one).
    assert {n.nvlink_domain for n in gpu if n.rack == "zone-b-rack-3"} == {"zone-b-rack-3-nvl0"}
    assert sorted(n.name for n in nodes if n.pool.gpus == 0) == ["cpu-zone-a-system-0", "cpu-zone-b-system-0"]


def test_cpu_nodes_are_untainted_without_gpu_labels_or_capacity() -> None:
    objects = {o["metadata"]["name"]: o for o in get_topology("default").node_objects()}
    cpu = objects["cpu-zone-a-system-0"]
    assert cpu["spec"]["taints"] == []
    assert GPU_RESOURCE not in cpu["status"]["capacity"] and RDMA_RESOURCE not in cpu["status"]["capacity"]
    assert not any(label.startswith("nvidia.com/") for label in cpu["metadata"]["labels"])
    assert cpu["metadata"]["labels"][ZONE_LABEL] == "zone-a"


def test_node_object_carries_capacity_labels_and_gpu_taint() -> None:
    objects = {o["metadata"]["name"]: o for o in get_topology("default").node_objects()}
    with_rdma = objects["gpu-zone-a-rack-1-0"]
    without_rdma = objects["gpu-zone-b-rack-2-3"]
    assert with_rdma["status"]["capacity"][GPU_RESOURCE] == "8"
    assert with_rdma["status"]["capacity"][RDMA_RESOURCE] == "8"
    assert RDMA_RESOURCE not in without_rdma["status"]["capacity"]
    labels = with_rdma["metadata"]["labels"]
    assert labels[ZONE_LABEL] == "zone-a"
    assert labels[RACK_LABEL] == "zone-a-rack-1"
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert labels["node.kubernetes.io/instance-type"] == "p5.48xlarge"
    assert labels["nvidia.com/gpu.clique"] == "zone-a-rack-1-nvl0"
    assert with_rdma["spec"]["taints"] == [{"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}]
    assert with_rdma["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"


def test_nvlink_domains_group_consecutive_nodes_of_a_rack() -> None:
    pool = NodePool(nvlink_domain_nodes=2)
    topology = grid("t", 1, 1, 5, pool=pool)
    assert [n.nvlink_domain for n in topology.nodes()] == [
        "zone-a-rack-1-nvl0",
        "zone-a-rack-1-nvl0",
        "zone-a-rack-1-nvl1",
        "zone-a-rack-1-nvl1",
        "zone-a-rack-1-nvl2",
    ]


def test_large_topology_has_over_a_hundred_nodes_with_unique_pod_cidrs() -> None:
    topology = get_topology("large")
    objects = topology.node_objects("198.19.0.0/17")
    assert len(objects) >= 100
    cidrs = [o["spec"]["podCIDR"] for o in objects]
    assert len(set(cidrs)) == len(cidrs)
    assert all(ipaddress.IPv4Network(c).subnet_of(ipaddress.IPv4Network("198.19.0.0/17")) for c in cidrs)
    assert len({o["metadata"]["name"] for o in objects}) == len(objects)
    products = {o["metadata"]["labels"]["nvidia.com/gpu.product"] for o in objects}
    assert products == {"NVIDIA-H100-80GB-HBM3", "NVIDIA-GB200"}


def test_too_small_pod_network_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="fewer /24 subnets"):
        get_topology("large").node_objects("198.19.0.0/20")


def test_minimal_and_none_presets() -> None:
    minimal = get_topology("minimal").nodes()
    assert len(minimal) == 2
    assert sorted(n.has_rdma for n in minimal) == [False, True]
    assert get_topology("none").nodes() == []


def test_unknown_topology_names_the_choices() -> None:
    with pytest.raises(ValueError, match="default, minimal, large"):
        get_topology("huge")


def test_topology_models_reject_bad_input() -> None:
    with pytest.raises(ValidationError):
        Rack(name="Rack_1", nodes=1)
    with pytest.raises(ValidationError):
        Zone(name="zone-a", racks=())
    with pytest.raises(ValidationError):
        NodePool(gpus=-1)
