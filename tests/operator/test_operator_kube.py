"""The real IO layer's side of the contract FakeKube copies: a non-leader sends nothing, events never raise.

The client points at a closed loopback port: a request that got past the guard would fail with a connection
error (ApiError code 0), so NotLeaderError and an empty request log prove nothing was sent.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubernetes import client as k8s
from prometheus_client import generate_latest

from pdserve_dev.testing.metrics import samples
from pdserve_dev.testing.net import free_port
from pdserve_operator.kinds import SERVICE
from pdserve_operator.kube import ApiError, KubeApi, NotLeaderError
from pdserve_operator.metrics import OperatorMetrics

SERVICE_OBJ = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "llama-router", "namespace": "default"}}
OWNER = {"metadata": {"name": "llama", "namespace": "default", "uid": "u1"}}


@pytest.fixture
def api_client() -> Iterator[k8s.ApiClient]:
    configuration = k8s.Configuration()
    configuration.host = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with k8s.ApiClient(configuration) as api_client:
        yield api_client


def test_a_non_leader_sends_no_write(api_client: k8s.ApiClient) -> None:
    metrics = OperatorMetrics()
    api = KubeApi(api_client, is_leader=lambda: False, metrics=metrics)
    with pytest.raises(NotLeaderError):
        api.apply(SERVICE_OBJ)
    with pytest.raises(NotLeaderError):
        api.delete(SERVICE, "default", "llama-router", "u1")
    with pytest.raises(NotLeaderError):
        api.patch_status("default", "llama", {"observedGeneration": 1})
    api.post_event(OWNER, "Normal", "Applied", "x", "2026-01-01T00:00:00Z")  # advisory: logged, not raised
    assert api.total_requests == 0 and api.total_writes == 0
    assert not [key for key in samples(generate_latest(metrics.registry).decode()) if "_total{" in key]


def test_a_leader_reaches_the_transport_and_counts_the_failure(api_client: k8s.ApiClient) -> None:
    metrics = OperatorMetrics()
    api = KubeApi(api_client, metrics=metrics)
    with pytest.raises(ApiError) as caught:
        api.apply(SERVICE_OBJ)
    assert caught.value.code == 0 and caught.value.retriable
    assert api.writes == {"apply Service": 1}
    exposed = samples(generate_latest(metrics.registry).decode())
    assert exposed['pdserve_operator_api_requests_total{code="error",kind="Service",verb="PATCH"}'] == 1
