"""The KV store pdserve deploys, on the local cluster: the operator renders the master and store server, the
process node runs the real `mooncake_master` and `mooncake_client` (the vLLM image's Mooncake, mapped to PyPI's CPU
build), the kubelet's probes of their health endpoints decide readiness, and status.kvStore reports it: ready,
then not ready while the master is down, then ready again once it is restarted.

The engines are left at zero replicas: the local cluster has no DNS, so the master's Service name, which engines
are given, does not resolve here (the chaos benchmark points engines at a master by address instead).
"""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve_dev.testing.cluster import ClusterHelper
from pdserve_dev.testing.operator import OperatorProcess
from pdserve_dev.testing.wait import wait_for

ROOT = Path(__file__).resolve().parents[2]
NAME = "store"
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def deployed(cluster: ClusterHelper, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, OperatorProcess]]:
    if cluster.process_node_workdir is None:
        pytest.skip("the local cluster runs without its process node")
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds" / "pdservice.yaml"))
    cluster.kubectl("wait", "--for=condition=Established", "crd/pdservices.pdserve.io", "--timeout=60s")
    namespace = cluster.create_namespace("kvstore")
    work = tmp_path_factory.mktemp("kvstore")
    with OperatorProcess(
        cluster.kubeconfig, work / "operator.log", namespaces=[namespace], identity="kvstore", lease_namespace=namespace
    ) as operator:
        operator.wait_ready()
        doc = yaml.safe_load((ROOT / "examples" / "local-sim.yaml").read_text())
        doc["metadata"] = {"name": NAME, "namespace": namespace}
        doc["spec"]["prefill"]["replicas"] = 0
        doc["spec"]["decode"]["replicas"] = 0
        doc["spec"]["engine"]["kvCache"] = {
            "store": {"backend": "mooncake", "mooncake": {"capacityBytes": "256Mi", "protocol": "tcp"}}
        }
        cluster.apply(json.dumps(doc))
        yield namespace, operator
    # The store's processes must not outlive the module (they ran on the process node's shared network).
    cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def kv_store(cluster: ClusterHelper, namespace: str) -> dict[str, Any]:
    status: dict[str, Any] = cluster.get_json(f"pds/{NAME}", "-n", namespace).get("status", {}).get("kvStore") or {}
    return status


def test_the_deployed_store_is_health_checked_and_reported(
    cluster: ClusterHelper, deployed: tuple[str, OperatorProcess]
) -> None:
    namespace, operator = deployed

    def ready() -> bool:
        return kv_store(cluster, namespace).get("ready") is True

    wait_for(
        ready, timeout=180, message=lambda: f"kvStore ready: {kv_store(cluster, namespace)}\n{operator.log_tail()}"
    )
    status = kv_store(cluster, namespace)
    assert status["managed"] is True and status["masterAddress"] == f"{NAME}-kvstore.{namespace}.svc:50051"
    [pod] = cluster.pods(namespace, "pdserve.io/role=kvstore")
    ip = pod["status"]["podIP"]
    # The real master answers on the pod's address, and the store server registered its segment with it.
    with urllib.request.urlopen(f"http://{ip}:9003/metrics", timeout=5) as response:
        metrics = response.read().decode()
    capacity = next(
        float(line.split()[1]) for line in metrics.splitlines() if line.startswith("master_total_capacity_bytes ")
    )
    assert capacity == 256 * 2**20

    # The master dies: its readiness probe fails, the pod is not ready, status says so; restarted, it is ready again.
    pid = cluster.container_process(namespace, pod["metadata"]["name"], "master").pid
    os.killpg(pid, signal.SIGKILL)
    wait_for(
        lambda: kv_store(cluster, namespace).get("ready") is False,
        timeout=120,
        message=lambda: f"kvStore not ready after the master died: {kv_store(cluster, namespace)}",
    )
    assert "no ready pod" in kv_store(cluster, namespace)["message"]
    wait_for(ready, timeout=180, message=lambda: f"kvStore ready again: {kv_store(cluster, namespace)}")
