"""The local cluster end to end: real scheduler, controllers and admission over kwok's simulated GPU nodes.

These tests share the session `cluster` (default topology: 24 GPU nodes, H100 (four without RDMA), H200 and GB200,
plus two CPU nodes); each works in its own namespace.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from pdserve_dev.cluster.topology import GPU_RESOURCE, RACK_LABEL, RDMA_LABEL, RDMA_RESOURCE, ZONE_LABEL
from pdserve_dev.testing.cluster import ClusterHelper
from pdserve_dev.testing.wait import wait_for

pytestmark = pytest.mark.cluster

Obj = dict[str, Any]


@pytest.fixture
def namespace(cluster: ClusterHelper) -> Iterator[str]:
    name = cluster.create_namespace("dc")
    try:
        yield name
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def _gpu_pod(name: str, gpus: int, rdma: int = 0) -> Obj:
    requests = {"cpu": "1", GPU_RESOURCE: str(gpus)}
    if rdma:
        requests[RDMA_RESOURCE] = str(rdma)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "containers": [{"name": "engine", "image": "vllm/vllm-openai:latest", "resources": {"limits": requests}}]
        },
    }


def _nodes(cluster: ClusterHelper) -> dict[str, Obj]:
    return {n["metadata"]["name"]: n for n in cluster.get_json("nodes")["items"]}


def _condition(obj: Obj, kind: str) -> Obj | None:
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == kind), None)


def test_kubectl_lists_the_gpu_nodes_with_capacity_and_labels(cluster: ClusterHelper) -> None:
    # Other tests of the session may add kwok nodes of their own (e.g. a CPU node for routers): count the topology's.
    listing = cluster.kubectl("get", "nodes", "--selector=type=kwok", "--no-headers").stdout
    topology_lines = [line for line in listing.splitlines() if line.startswith(("gpu-", "cpu-"))]
    assert len(topology_lines) == 26
    assert all(" Ready " in line for line in topology_lines)
    nodes = {name: n for name, n in _nodes(cluster).items() if name.startswith("gpu-")}
    assert len(nodes) == 24
    for name, node in nodes.items():
        capacity = node["status"]["capacity"]
        labels = node["metadata"]["labels"]
        assert capacity[GPU_RESOURCE] == "8"
        assert node["status"]["allocatable"][GPU_RESOURCE] == "8"
        assert (RDMA_RESOURCE in capacity) == (labels[RDMA_LABEL] == "true"), name
        assert labels[ZONE_LABEL] in {"zone-a", "zone-b"}
        assert labels[RACK_LABEL].startswith(labels[ZONE_LABEL])
        assert labels["nvidia.com/gpu.product"] in {"NVIDIA-H100-80GB-HBM3", "NVIDIA-H200", "NVIDIA-GB200"}
        assert {"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"} in node["spec"]["taints"]
    assert sum(RDMA_RESOURCE not in n["status"]["capacity"] for n in nodes.values()) == 4


def test_gpu_and_rdma_pods_land_only_on_kwok_nodes_that_have_both(cluster: ClusterHelper, namespace: str) -> None:
    # Ten 8-GPU pods that also need RDMA: twenty nodes qualify, so all fit, none on the four without RDMA.
    names = [f"engine-{i}" for i in range(10)]
    cluster.apply([_gpu_pod(name, gpus=8, rdma=1) for name in names], namespace=namespace)

    def running() -> list[Obj] | None:
        pods = cluster.pods(namespace)
        ok = len(pods) == len(names) and all(p["status"].get("phase") == "Running" for p in pods)
        return pods if ok else None

    pods = wait_for(running, timeout=60, message="ten GPU pods Running")
    nodes = _nodes(cluster)
    placed = [p["spec"]["nodeName"] for p in pods]
    assert len(set(placed)) == len(placed), "each pod takes all 8 GPUs of its node"
    for pod, node_name in zip(pods, placed, strict=True):
        node = nodes[node_name]
        assert node["metadata"]["annotations"].get("kwok.x-k8s.io/node") == "fake"
        assert node["metadata"]["labels"][RDMA_LABEL] == "true"
        ready = _condition(pod, "Ready")
        assert ready is not None and ready["status"] == "True"
        assert pod["status"]["podIP"], "kwok assigned a fake pod IP"
        # ExtendedResourceToleration added the toleration for the GPU taint the test never wrote.
        assert any(t.get("key") == GPU_RESOURCE for t in pod["spec"]["tolerations"])
    assert len(cluster.pod_ips(namespace)) == len(names)


def test_an_impossible_request_stays_pending_with_the_schedulers_reason(cluster: ClusterHelper, namespace: str) -> None:
    cluster.apply(_gpu_pod("too-big", gpus=16, rdma=1), namespace=namespace)

    def unschedulable() -> Obj | None:
        pod = cluster.get_json("pod", "too-big", f"--namespace={namespace}")
        condition = _condition(pod, "PodScheduled")
        return condition if condition and condition.get("reason") == "Unschedulable" else None

    condition = wait_for(unschedulable, timeout=30, message="PodScheduled=False/Unschedulable")
    assert condition["status"] == "False"
    assert "Insufficient nvidia.com/gpu" in condition["message"]
    pod = cluster.get_json("pod", "too-big", f"--namespace={namespace}")
    assert pod["status"]["phase"] == "Pending"
    assert "nodeName" not in pod["spec"]


def test_garbage_collection_deletes_owned_objects(cluster: ClusterHelper, namespace: str) -> None:
    cluster.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owner"}}, namespace=namespace)
    owner = cluster.get_json("configmap", "owner", f"--namespace={namespace}")
    reference = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"]}
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "owned", "ownerReferences": [reference]},
            "data": {"k": "v"},
        },
        namespace=namespace,
    )
    cluster.kubectl("delete", "configmap", "owner", f"--namespace={namespace}")

    def owned_gone() -> bool:
        return cluster.kubectl("get", "configmap", "owned", f"--namespace={namespace}", check=False).returncode != 0

    wait_for(owned_gone, timeout=30, message="the garbage collector deleting the owned ConfigMap")


def test_deployment_pdb_and_endpointslices_follow_kwok_pods(cluster: ClusterHelper, namespace: str) -> None:
    labels = {"app": "decode"}
    pod = _gpu_pod("decode", gpus=1)
    template = {"metadata": {"labels": labels}, "spec": pod["spec"]}
    cluster.apply(
        [
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": "decode"},
                "spec": {"replicas": 3, "selector": {"matchLabels": labels}, "template": template},
            },
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": "decode"},
                "spec": {"selector": labels, "ports": [{"name": "http", "port": 8000}]},
            },
            {
                "apiVersion": "policy/v1",
                "kind": "PodDisruptionBudget",
                "metadata": {"name": "decode"},
                "spec": {"minAvailable": 2, "selector": {"matchLabels": labels}},
            },
        ],
        namespace=namespace,
    )

    def available() -> bool:
        status = cluster.get_json("deployment", "decode", f"--namespace={namespace}").get("status", {})
        return bool(status.get("availableReplicas") == 3)

    wait_for(available, timeout=60, message="3 available replicas")

    def pdb_counts() -> Obj | None:
        status = cluster.get_json("pdb", "decode", f"--namespace={namespace}").get("status", {})
        return status if status.get("currentHealthy") == 3 else None

    status = wait_for(pdb_counts, timeout=30, message="PDB status from the disruption controller")
    assert status["disruptionsAllowed"] == 1

    local = cluster.local
    if local is not None and not local.network.local_route:
        pytest.skip("pod IPs are loopback here; kube-apiserver refuses them in EndpointSlices")

    def sliced() -> set[str] | None:
        slices = cluster.get_json(
            "endpointslices", f"--namespace={namespace}", "--selector=kubernetes.io/service-name=decode"
        )["items"]
        ips = {a for s in slices for e in s.get("endpoints") or [] for a in e["addresses"]}
        return ips if len(ips) == 3 else None

    assert wait_for(sliced, timeout=30, message="3 endpoints") == set(cluster.pod_ips(namespace, "app=decode"))


def test_kube_apiserver_stops_and_starts_again_with_the_cluster_state_kept(
    cluster: ClusterHelper, namespace: str
) -> None:
    """The chaos benchmark's apiserver-restart fault: the process the cluster started is stopped (clients are
    refused), then started again on the same address, with etcd's objects still there."""
    if cluster.local is None:
        pytest.skip("a reused cluster: its kube-apiserver is not this session's to restart")
    cluster.kubectl("create", "configmap", "kept", f"--namespace={namespace}", "--from-literal=k=v")
    cluster.local.stop_apiserver()
    try:
        refused = cluster.kubectl("get", "configmap", "kept", f"--namespace={namespace}", check=False, timeout=30)
        assert refused.returncode != 0
    finally:
        cluster.local.start_apiserver()
    assert cluster.get_json("configmap", "kept", f"--namespace={namespace}")["data"] == {"k": "v"}
    # The controllers reconnected too: a Deployment still gets its ReplicaSet and pods scheduled.
    cluster.kubectl("create", "deployment", "after", "--image=busybox", f"--namespace={namespace}")
    wait_for(
        lambda: cluster.get_json("replicasets", f"--namespace={namespace}")["items"],
        timeout=60,
        message="the Deployment controller acting after the restart",
    )
