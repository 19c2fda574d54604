"""Pods on the process node get in-cluster configuration the way a kubelet provides it, and their securityContext.

Each test uses its own namespace. The pods use the pdserve image (the image map runs it as this install, as the
image's user 65532) and tolerate the process node's taint.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdserve_dev.process_node.kube import Kube
from pdserve_dev.process_node.tokens import ProjectedToken
from pdserve_dev.testing.cluster import ClusterHelper
from pdserve_dev.testing.wait import wait_for

pytestmark = pytest.mark.cluster

Obj = dict[str, Any]
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# The chart's container securityContext (charts/pdserve/values.yaml).
LOCKED_DOWN = {
    "runAsNonRoot": True,
    "readOnlyRootFilesystem": True,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}

# What an in-cluster client sees, printed as one JSON line.
PROBE = (
    f"SA_DIR = {SA_DIR!r}\n"
    + r"""
import base64, json, os, socket
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from pdserve.api.kubeclient import new_api_client, resolve
core = client.CoreV1Api(new_api_client())
own = sorted(p.metadata.name for p in core.list_namespaced_pod(os.environ["POD_NAMESPACE"]).items)
try:
    core.list_namespaced_pod("kube-system")
    elsewhere = 200
except ApiException as exc:
    elsewhere = exc.status
token = open(os.path.join(SA_DIR, "token")).read()
claims = json.loads(base64.urlsafe_b64decode(token.split(".")[1] + "=="))
print(json.dumps({
    "source": resolve().origin, "host": os.environ["KUBERNETES_SERVICE_HOST"],
    "port": os.environ["KUBERNETES_SERVICE_PORT"], "kubeconfig": os.environ.get("KUBECONFIG"), "own": own,
    "elsewhere": elsewhere, "hostname": socket.gethostname(), "uid": os.getuid(), "home": os.environ["HOME"],
    "subject": claims["sub"], "bound_pod": claims["kubernetes.io"]["pod"]["name"],
    "namespace": open(os.path.join(SA_DIR, "namespace")).read(),
}))
"""
)


@pytest.fixture
def namespace(cluster: ClusterHelper) -> Iterator[str]:
    if cluster.process_node_workdir is None:
        pytest.skip("the cluster has no process node")
    name = cluster.create_namespace("sa")
    try:
        yield name
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def _pod(name: str, container: Obj, **spec: Any) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {"pdserve.io/process-node": "true"},
            "tolerations": [{"key": "pdserve.io/process-node", "operator": "Exists", "effect": "NoSchedule"}],
            "terminationGracePeriodSeconds": 2,
            "containers": [container],
            **spec,
        },
    }


def _status(cluster: ClusterHelper, namespace: str, name: str) -> Obj:
    status: Obj = cluster.get_json("pod", name, f"--namespace={namespace}")["status"]
    return status


def _reader(cluster: ClusterHelper, namespace: str) -> None:
    """ServiceAccount `reader`, allowed to list pods in its namespace only."""
    cluster.kubectl("create", "serviceaccount", "reader", f"--namespace={namespace}")
    cluster.kubectl("create", "role", "reader", "--verb=list", "--resource=pods", f"--namespace={namespace}")
    subject = f"--serviceaccount={namespace}:reader"
    cluster.kubectl("create", "rolebinding", "reader", "--role=reader", subject, f"--namespace={namespace}")


def test_a_pod_reaches_the_api_with_its_own_service_account_token(cluster: ClusterHelper, namespace: str) -> None:
    _reader(cluster, namespace)
    container = {
        "name": "probe",
        "image": "ghcr.io/pdserve/pdserve:0.1.0",
        "command": ["python", "-c", PROBE],
        "env": [{"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}],
        "securityContext": LOCKED_DOWN,
    }
    cluster.apply(_pod("probe", container, serviceAccountName="reader", restartPolicy="Never"), namespace=namespace)
    wait_for(
        lambda: _status(cluster, namespace, "probe").get("phase") in ("Succeeded", "Failed"),
        timeout=60,
        message=lambda: f"the probe to finish: {_status(cluster, namespace, 'probe')}",
    )
    log = cluster.logs(namespace, "probe")
    assert _status(cluster, namespace, "probe")["phase"] == "Succeeded", log
    seen = json.loads(log.strip().splitlines()[-1])
    kubernetes = cluster.get_json("service", "kubernetes", "--namespace=default")["spec"]
    assert seen["source"] == "in-cluster" and seen["kubeconfig"] is None
    if cluster.local is not None and cluster.local.network.local_route:
        # The Service's ClusterIP, relayed by the process node like kube-proxy would.
        assert (seen["host"], seen["port"]) == (kubernetes["clusterIP"], str(kubernetes["ports"][0]["port"]))
    assert seen["own"] == ["probe"]
    assert seen["elsewhere"] == 403  # the ServiceAccount's RBAC, not an admin identity
    assert seen["subject"] == f"system:serviceaccount:{namespace}:reader"
    assert seen["bound_pod"] == "probe" and seen["namespace"] == namespace
    assert (seen["hostname"], seen["uid"], seen["home"]) == ("probe", 65532, "/")
    events = cluster.get_json("events", f"--namespace={namespace}", "--field-selector=involvedObject.name=probe")
    reported = [e["message"] for e in events["items"] if e["reason"] == "SecurityContextNotEmulated"]
    assert reported == ["Not emulated by the process node: seccompProfile RuntimeDefault"]


def test_run_as_non_root_refuses_an_image_that_runs_as_root(cluster: ClusterHelper, namespace: str) -> None:
    container = {"name": "shell", "image": "busybox", "command": ["sleep", "300"], "securityContext": LOCKED_DOWN}
    cluster.apply(_pod("rooted", container), namespace=namespace)

    def refused() -> Obj | None:
        statuses = _status(cluster, namespace, "rooted").get("containerStatuses") or [{}]
        waiting: Obj = statuses[0].get("state", {}).get("waiting", {})
        return waiting if waiting.get("reason") == "CreateContainerConfigError" else None

    waiting = wait_for(refused, timeout=30, message=lambda: str(_status(cluster, namespace, "rooted")))
    assert waiting["message"] == "container has runAsNonRoot and image will run as root (pod: rooted, container: shell)"


def _review(cluster: ClusterHelper, token: str) -> Obj:
    review = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": token}}
    status: Obj = json.loads(cluster.kubectl("create", "-f", "-", "-o", "json", input=json.dumps(review)).stdout)[
        "status"
    ]
    return status


def test_projected_tokens_are_bound_to_their_pod_and_replaced_on_refresh(
    cluster: ClusterHelper, namespace: str, tmp_path: Path
) -> None:
    """The TokenRequest the process node makes, against the real API server: a token for the pod's ServiceAccount
    that authenticates while the pod exists, a fresh one on refresh, and none once the pod is gone."""
    cluster.apply(_pod("holder", {"name": "c", "image": "busybox", "command": ["sleep", "300"]}), namespace=namespace)
    pod = cluster.get_json("pod", "holder", f"--namespace={namespace}")
    kube = Kube(str(cluster.kubeconfig))
    token = ProjectedToken.from_source({"path": "token", "expirationSeconds": 600}, tmp_path, 0o644, None)
    token.refresh(kube, pod)
    first = (tmp_path / "token").read_text()
    token.refresh(kube, pod)
    second = (tmp_path / "token").read_text()
    assert first != second
    for value in (first, second):
        status = _review(cluster, value)
        assert status["authenticated"] is True
        assert status["user"]["username"] == f"system:serviceaccount:{namespace}:default"
        assert status["user"]["extra"]["authentication.kubernetes.io/pod-name"] == ["holder"]
    cluster.kubectl("delete", "pod", "holder", f"--namespace={namespace}", "--wait=true", timeout=60)
    # The API server caches successful token reviews for a few seconds: wait for the verdict to change.
    wait_for(lambda: _review(cluster, second).get("authenticated") is not True, timeout=30)
