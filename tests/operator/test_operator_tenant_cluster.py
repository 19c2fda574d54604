"""What a namespace user holding only the built-in `edit` ClusterRole can and cannot make the operator do, on the
real local cluster (API server, its RBAC and garbage collector, kwok nodes).

The tenant is a ServiceAccount bound to `edit` (plus PDServices, which the chart aggregates into `edit`) and acts
through its own TokenRequest token (`ClusterHelper.edit_user`): every object it makes, it makes with exactly those
permissions. The operator is a real `pdserve operator` process with the admin's credentials, namespaced to the
test's namespace. Issue 18, items 2 and 3:

- adoption by name: objects of a PDService child's name that another user made before (a Role, its RoleBinding,
  a ConfigMap) are never taken over, not even when the tenant names its PDService after them; the PDService says
  Degraded/ChildConflict naming them, and deleting it garbage-collects none of them;
- forged pods: a pod the tenant labels as one of a PDService's engines (unschedulable, asking for GPUs no node has)
  is not counted: the PDService stays Ready instead of PodsPending, and the pod is reported in one Event.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.api.crdgen import custom_resource_definition
from pdserve_dev.testing.cluster import ClusterHelper
from pdserve_dev.testing.operator import OperatorProcess, ensure_cpu_node
from pdserve_dev.testing.wait import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "pdservice.yaml"
KWOK_PRODUCT = "NVIDIA-H100-80GB-HBM3"


def example(name: str) -> dict[str, Any]:
    """examples/pdservice.yaml on the kwok topology (H100 nodes), small pools."""
    document: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    document["metadata"] = {"name": name}
    document["spec"]["placement"]["gpuNodeSelector"] = {"nvidia.com/gpu.product": KWOK_PRODUCT}
    document["spec"]["prefill"]["replicas"] = 1
    document["spec"]["decode"]["replicas"] = 1
    del document["spec"]["model"]["hfTokenSecret"]
    return document


def condition(body: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((dict(c) for c in (body.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


@pytest.fixture(scope="module")
def namespace(cluster: ClusterHelper) -> Iterator[str]:
    text = yaml.safe_dump(custom_resource_definition())
    wait_for(lambda: cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=text), 60)
    cluster.wait_crd_established()
    wait_for(lambda: cluster.kubectl("get", "pdservices.pdserve.io", "--all-namespaces"), 60)
    ensure_cpu_node(cluster)
    name = cluster.create_namespace("tenant")
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def tenant(cluster: ClusterHelper, namespace: str, tmp_path_factory: pytest.TempPathFactory) -> ClusterHelper:
    """The hostile namespace user: `edit` in the namespace, acting with its own token."""
    user = cluster.edit_user(namespace, "tenant", tmp_path_factory.mktemp("tenant") / "kubeconfig")
    assert user.kubectl("auth", "can-i", "create", "roles", check=False).returncode != 0  # edit: no RBAC
    assert user.kubectl("auth", "can-i", "create", "pdservices.pdserve.io").stdout.strip() == "yes"
    return user


@pytest.fixture(scope="module")
def operator(
    cluster: ClusterHelper, namespace: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    process = OperatorProcess(
        cluster.kubeconfig,
        tmp_path_factory.mktemp("operator") / "operator.log",
        namespaces=[namespace],
        identity="tenant",
        lease_name=f"pdserve-operator-{namespace}",
        lease_namespace=namespace,
        extra=["--resync-seconds", "5"],
    ).start()
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


def another_users_objects(namespace: str) -> list[dict[str, Any]]:
    """What a team that was there first keeps under the names `victim-router`: a Role and its RoleBinding (alice
    reads the namespace's Secrets), and a ConfigMap."""
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": "victim-router", "namespace": namespace},
            "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "list"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": "victim-router", "namespace": namespace},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "victim-router"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "alice"}],
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "victim-router", "namespace": namespace},
            "data": {"settings": "team-b"},
        },
    ]


def test_a_tenant_cannot_make_the_operator_take_over_or_delete_another_users_objects(
    cluster: ClusterHelper, namespace: str, tenant: ClusterHelper, operator: OperatorProcess
) -> None:
    kinds = "role,rolebinding,configmap"
    cluster.apply(another_users_objects(namespace), namespace=namespace)  # as the namespace's admin
    before = {(o["kind"], o["metadata"]["name"]): o for o in cluster.get_json(kinds, "-n", namespace)["items"]}
    assert cluster.can_i(namespace, "alice", "get", "secrets")

    tenant.apply(example("victim"), namespace=namespace)
    operator.wait_reconciles(2)  # the pass the PDService's event queued, and one more (resync every 5 s)

    # Nothing of theirs changed hands: same rules, subjects and data, no controller reference; and nothing else was
    # created around them (the router would have run under a binding to a Role that is not ours).
    after = {(o["kind"], o["metadata"]["name"]): o for o in cluster.get_json(kinds, "-n", namespace)["items"]}
    for key, old in before.items():
        new = after[key]
        for field in ("rules", "subjects", "roleRef", "data"):
            assert new.get(field) == old.get(field), (key, field)
        assert not new["metadata"].get("ownerReferences"), key
        assert new["metadata"]["uid"] == old["metadata"]["uid"]
    assert cluster.can_i(namespace, "alice", "get", "secrets")
    assert cluster.get_json("statefulsets,deployments,services", "-n", namespace)["items"] == []

    def conflict() -> dict[str, Any] | None:
        body: dict[str, Any] = cluster.get_json("pdservices.pdserve.io", "victim", "-n", namespace)
        degraded = condition(body, "Degraded")
        return body if degraded.get("reason") == "ChildConflict" else None

    body = wait_for(conflict, 30, message=lambda: f"Degraded/ChildConflict\n{operator.log_tail()}")
    message = condition(body, "Degraded")["message"]
    for kind in ("Role", "RoleBinding", "ConfigMap"):
        assert f"{kind} victim-router exists and is not controlled by any owner" in message
    assert condition(body, "Stalled")["status"] == "True"
    events = cluster.get_json("events", "-n", namespace, "--field-selector=involvedObject.name=victim")["items"]
    assert [e["reason"] for e in events if e["type"] == "Warning"] == ["ChildConflict"]

    # The tenant deletes its PDService. A marker the PDService owns shows when the garbage collector has acted on
    # that deletion (the counted event); by then it would have taken anything else carrying the PDService's
    # controller reference too.
    uid = body["metadata"]["uid"]
    owner = {"apiVersion": "pdserve.io/v1alpha1", "kind": "PDService", "name": "victim", "uid": uid}
    marker = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "victim-marker", "ownerReferences": [owner]},
    }
    cluster.apply(marker, namespace=namespace)
    tenant.kubectl("delete", "pdservices.pdserve.io", "victim", "-n", namespace)
    wait_for(
        lambda: cluster.kubectl("get", "configmap", "victim-marker", "-n", namespace, check=False).returncode != 0,
        60,
        message="the garbage collector to delete the PDService's own marker",
    )
    left = {(o["kind"], o["metadata"]["name"]): o for o in cluster.get_json(kinds, "-n", namespace)["items"]}
    for key, old in before.items():
        assert left[key]["metadata"]["uid"] == old["metadata"]["uid"], key
    assert cluster.can_i(namespace, "alice", "get", "secrets")


def test_a_tenants_pod_labelled_as_an_engine_is_neither_counted_nor_trusted(
    cluster: ClusterHelper, namespace: str, tenant: ClusterHelper, operator: OperatorProcess
) -> None:
    tenant.apply(example("demo"), namespace=namespace)
    cluster.kubectl("wait", "--for=condition=Ready", "pdservices.pdserve.io/demo", "-n", namespace, "--timeout=120s")

    # The tenant's own pod with demo's prefill labels, asking for GPUs no node has: the scheduler keeps it Pending.
    labels = {
        "app.kubernetes.io/name": "pdserve",
        "app.kubernetes.io/instance": "demo",
        "app.kubernetes.io/managed-by": "pdserve-operator",
        "pdserve.io/role": "prefill",
    }
    container = {"name": "vllm", "image": "vllm/vllm-openai:v0.32.0", "resources": {"limits": {"nvidia.com/gpu": "64"}}}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "intruder", "labels": labels}}
    pod["spec"] = {"containers": [container], "nodeSelector": {"nvidia.com/gpu.product": KWOK_PRODUCT}}
    tenant.apply(pod, namespace=namespace)

    def unschedulable() -> bool:
        conditions = cluster.get_json("pod", "intruder", "-n", namespace)["status"].get("conditions") or []
        return any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conditions)

    wait_for(unschedulable, 60, message="the scheduler to refuse the tenant's pod")
    # Passes after the scheduler's verdict (resync every 5 s) still count only demo's own pods.
    operator.wait_reconciles(3)
    body = cluster.get_json("pdservices.pdserve.io", "demo", "-n", namespace)
    assert condition(body, "Degraded")["reason"] == "AsExpected"
    assert condition(body, "Ready")["status"] == "True"

    def reported() -> list[dict[str, Any]]:
        items = cluster.get_json("events", "-n", namespace, "--field-selector=involvedObject.name=demo")["items"]
        return [e for e in items if e["reason"] == "ForeignPodIgnored"]

    events = wait_for(reported, 30, message=lambda: f"a ForeignPodIgnored Event\n{operator.log_tail()}")
    assert events[0]["message"].startswith("Ignored pod intruder (pdserve.io/role=prefill)")
    assert len(events) == 1 and events[0].get("count", 1) == 1  # once, over every pass since
    tenant.kubectl("delete", "pod", "intruder", "-n", namespace, "--wait=false")
