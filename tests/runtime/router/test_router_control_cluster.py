"""Two router replicas against the local cluster's API server: both apply the published PD threshold (the router
control ConfigMap) as soon as it changes, fall back to the static one when it is malformed or gone, and count the
ready router replicas in their Service's EndpointSlices (the N that divides every engine's budget).

The routers are local processes in Kubernetes mode with the cluster's kubeconfig (the Role is checked end to end
in `tests/e2e/test_e2e_router_discovery.py`); they need no engines for what is checked here.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve_dev.testing.cluster import ClusterHelper
from pdserve_dev.testing.metrics import metric_value
from pdserve_dev.testing.net import free_port
from pdserve_dev.testing.wait import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

CONTROL = "llm-router-control"
SERVICE = "llm-router"
STATIC = 256
# The autoscaler decides once per tick (`--autoscaler-interval-seconds`, 15 s by default): every replica must
# use a new value within one.
TICK_SECONDS = 15.0


@pytest.fixture
def namespace(cluster: ClusterHelper) -> Iterator[str]:
    name = cluster.create_namespace("control")
    try:
        yield name
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@contextlib.contextmanager
def routers(cluster: ClusterHelper, namespace: str, tmp_path: Path, count: int) -> Iterator[list[str]]:
    """`count` router processes; yields the base URLs of their metrics ports."""
    procs: list[subprocess.Popen[bytes]] = []
    metrics: list[str] = []
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "PDSERVE_BIND_HOST": "127.0.0.1"}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    try:
        for index in range(count):
            port, metrics_port = free_port("127.0.0.1"), free_port("127.0.0.1")
            config = {
                "servedModelName": "sim-model",
                "port": port,
                "metricsPort": metrics_port,
                "discovery": "kubernetes",
                "decode": {"namespace": namespace, "labelSelector": "pdserve.io/role=decode"},
                "policy": {"disaggregationThresholdTokens": STATIC},
                "admission": {
                    "prefillBudgetTokens": 12288,
                    "peers": {"namespace": namespace, "labelSelector": f"kubernetes.io/service-name={SERVICE}"},
                },
                "routerControl": {"namespace": namespace, "name": CONTROL},
            }
            path = tmp_path / f"router-{index}.yaml"
            path.write_text(yaml.safe_dump(config))
            log = (tmp_path / f"router-{index}.log").open("wb")
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "pdserve.cli", "router", "--config", str(path)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
            log.close()
            metrics.append(f"http://127.0.0.1:{metrics_port}")
        yield metrics
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def gauge(metrics: str, name: str) -> float | None:
    try:
        with urllib.request.urlopen(metrics + "/metrics", timeout=3) as response:
            return metric_value(response.read().decode(), name)
    except OSError:
        return None


def all_show(metrics: list[str], name: str, value: float) -> bool:
    return all(gauge(url, name) == value for url in metrics)


def control_map(data: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": CONTROL}, "data": data}


def published(threshold: object, reason: str = "prefill saturated") -> dict[str, Any]:
    document = {"disaggregationThreshold": threshold, "reason": reason, "decidedAt": "2026-12-02T10:00:00Z"}
    return control_map({"control.json": json.dumps(document)})


def endpoint_slice(ready: list[str], not_ready: list[str]) -> dict[str, Any]:
    endpoints = [{"addresses": [ip], "conditions": {"ready": True}} for ip in ready]
    endpoints += [{"addresses": [ip], "conditions": {"ready": False}} for ip in not_ready]
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": f"{SERVICE}-abcde", "labels": {"kubernetes.io/service-name": SERVICE}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": endpoints,
    }


def test_every_router_replica_applies_the_published_threshold_within_a_tick(
    cluster: ClusterHelper, namespace: str, tmp_path: Path
) -> None:
    name = "pdserve_router_disaggregation_threshold"
    with routers(cluster, namespace, tmp_path, 2) as metrics:
        wait_for(lambda: all_show(metrics, name, STATIC), timeout=60, message="both routers up, static threshold")
        for value in (1024, 0, 64):
            cluster.apply(published(value), namespace=namespace)
            started = time.monotonic()
            wait_for(partial(all_show, metrics, name, value), timeout=2 * TICK_SECONDS, message=f"both use {value}")
            assert time.monotonic() - started < TICK_SECONDS
        # Malformed: the static threshold, and the router says why.
        cluster.apply(published("many"), namespace=namespace)
        wait_for(lambda: all_show(metrics, name, STATIC), timeout=2 * TICK_SECONDS, message="malformed: static")
        logs = [(tmp_path / f"router-{index}.log").read_text() for index in range(2)]
        assert all("Ignored router control configmap=llm-router-control" in log for log in logs), logs
        cluster.apply(published(2048), namespace=namespace)
        wait_for(lambda: all_show(metrics, name, 2048), timeout=2 * TICK_SECONDS, message="both use 2048")
        cluster.kubectl("delete", "configmap", CONTROL, f"--namespace={namespace}")
        wait_for(lambda: all_show(metrics, name, STATIC), timeout=2 * TICK_SECONDS, message="deleted: static")


def test_router_replicas_are_counted_from_their_services_ready_endpoints(
    cluster: ClusterHelper, namespace: str, tmp_path: Path
) -> None:
    name = "pdserve_router_replicas"
    with routers(cluster, namespace, tmp_path, 2) as metrics:
        wait_for(lambda: all_show(metrics, name, 1), timeout=60, message="both routers up, alone")
        cluster.apply(endpoint_slice(["10.1.0.1", "10.1.0.2"], ["10.1.0.3"]), namespace=namespace)
        wait_for(lambda: all_show(metrics, name, 2), timeout=30, message="2 ready replicas")
        cluster.apply(endpoint_slice(["10.1.0.1", "10.1.0.2", "10.1.0.3"], []), namespace=namespace)
        wait_for(lambda: all_show(metrics, name, 3), timeout=30, message="3 ready replicas")
        cluster.apply(endpoint_slice(["10.1.0.2"], ["10.1.0.1", "10.1.0.3"]), namespace=namespace)
        wait_for(lambda: all_show(metrics, name, 1), timeout=30, message="1 ready replica")
