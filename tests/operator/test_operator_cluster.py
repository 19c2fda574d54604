"""The operator against the real local cluster (kube-apiserver, controllers, scheduler, kwok GPU nodes).

The operator runs as a real `pdserve operator` subprocess, namespaced to the test's own namespace with its own
Lease, so these tests never see (or fight) anything else on the shared cluster. kwok marks scheduled pods Running
and Ready; all kwok GPU nodes are tainted, so a plain kwok CPU node is added for the router pods.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.api.crdgen import custom_resource_definition
from pdserve.api.defaults import effective
from pdserve.api.kubeclient import new_api_client
from pdserve.api.kvcompat import KV_COMPAT_LABEL, kv_compat_hash
from pdserve.api.policy import DEFAULT_POLICY
from pdserve.api.settings import OperatorSettings
from pdserve.api.v1alpha1 import PDService
from pdserve.api.validation import validate
from pdserve_dev.testing.cluster import ClusterHelper
from pdserve_dev.testing.operator import OperatorProcess, ensure_cpu_node
from pdserve_dev.testing.wait import wait_for, wait_for_async, wait_until_none_left
from pdserve_operator import drift
from pdserve_operator.controller import Controller
from pdserve_operator.kinds import SERVICE_ACCOUNT
from pdserve_operator.kube import KubeApi
from pdserve_operator.metrics import OperatorMetrics
from pdserve_operator.reconcile import observe
from pdserve_operator.render import render
from pdserve_operator.view import SpecViews

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "pdservice.yaml"
KWOK_PRODUCT = "NVIDIA-H100-80GB-HBM3"
CHILD_KINDS = "serviceaccounts,roles,rolebindings,configmaps,services,statefulsets,poddisruptionbudgets,deployments"


# ------------------------------------------------------------------------------------------------------ helpers


def example(name: str, namespace: str) -> dict[str, Any]:
    """examples/pdservice.yaml adjusted to the kwok topology (H100 nodes instead of H200)."""
    document: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    document["metadata"] = {"name": name, "namespace": namespace}
    document["spec"]["placement"]["gpuNodeSelector"] = {"nvidia.com/gpu.product": KWOK_PRODUCT}
    del document["spec"]["model"]["hfTokenSecret"]  # no Secret in the test namespace; not needed by kwok
    return document


def pds_get(cluster: ClusterHelper, namespace: str, name: str) -> dict[str, Any]:
    result: dict[str, Any] = cluster.get_json("pdservices.pdserve.io", name, f"--namespace={namespace}")
    return result


def condition(pds: dict[str, Any], type_: str) -> dict[str, Any]:
    for item in (pds.get("status") or {}).get("conditions") or []:
        if item["type"] == type_:
            return dict(item)
    return {}


def children(cluster: ClusterHelper, namespace: str, name: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cluster.get_json(
        CHILD_KINDS, f"--namespace={namespace}", f"--selector=app.kubernetes.io/instance={name}"
    ).get("items", [])
    return items


class KubectlNodes:
    """Node labels as the operator reads them (`nodes.NodeLabels`), through kubectl."""

    def __init__(self, cluster: ClusterHelper) -> None:
        self.cluster = cluster

    def labels(self, names: Iterable[str]) -> dict[str, Mapping[str, str]]:
        return {name: self.cluster.get_json("node", name)["metadata"].get("labels", {}) for name in names}


def rendered(cluster: ClusterHelper, namespace: str, name: str) -> list[dict[str, Any]]:
    """What the operator renders now: from the spec and, as the operator does, the engine pods' kv-compat values,
    the labels of their nodes and the Services the PDService controls (`reconcile.observe`)."""
    body = pds_get(cluster, namespace, name)
    checked = validate({k: v for k, v in body.items() if k != "status"})
    pods = cluster.pods(namespace, f"app.kubernetes.io/instance={name}")
    uid = body["metadata"]["uid"]
    services = {
        s["metadata"]["name"]: s["metadata"]["uid"]
        for s in cluster.get_json("services", f"--namespace={namespace}")["items"]
        if any(r.get("uid") == uid and r.get("controller") for r in s["metadata"].get("ownerReferences") or [])
    }
    return render(checked, observe(pods, checked.require()[1], KubectlNodes(cluster), services=services))


def pdservice_count(cluster: ClusterHelper, namespace: str) -> int:
    return len(cluster.get_json("pdservices.pdserve.io", f"--namespace={namespace}").get("items", []))


def wait_resyncs(cluster: ClusterHelper, namespace: str, operator: OperatorProcess, rounds: int) -> None:
    """Wait for about `rounds` reconcile passes of every PDService in the namespace (the pass counter is not per
    PDService; each resync queues all of them): the counted event before asserting something did not happen."""
    operator.wait_reconciles(rounds * max(1, pdservice_count(cluster, namespace)))


def settle(cluster: ClusterHelper, namespace: str, operator: OperatorProcess) -> None:
    """Wait until a full resync round of passes wrote nothing (trailing status updates of a rollout are over)."""
    operator.wait_quiet(max(1, pdservice_count(cluster, namespace)))


def render_gaps(cluster: ClusterHelper, namespace: str, name: str) -> list[str]:
    """The rendered objects the cluster lacks or holds with other values (`drift.contains`), as "Kind/name"."""
    observed = {(o["kind"], o["metadata"]["name"]): o for o in children(cluster, namespace, name)}
    gaps = []
    for obj in rendered(cluster, namespace, name):
        have = observed.get((obj["kind"], obj["metadata"]["name"]))
        if have is None or not drift.contains(obj, have):
            gaps.append(f"{obj['kind']}/{obj['metadata']['name']}" + (" missing" if have is None else ""))
    return gaps


def wait_matches_render(cluster: ClusterHelper, namespace: str, name: str, timeout: float = 30) -> None:
    """Wait until every rendered object is in the cluster as rendered. Waited for, not asserted at one instant: the
    render follows the pods (their kv-compat values, their nodes' topology labels), so a pod the StatefulSet
    controller replaces just before the check changes the render until the operator's next pass (seconds). On
    timeout the message names what still differs."""
    wait_until_none_left(
        lambda: render_gaps(cluster, namespace, name), timeout, 0.5, "the children to match the render"
    )


# ----------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def crd(cluster: ClusterHelper) -> None:
    # Retried: right after the cluster comes up, the first requests can still fail transiently.
    text = yaml.safe_dump(custom_resource_definition())
    wait_for(lambda: cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=text), 60)
    cluster.wait_crd_established()
    # The CRD is established but discovery may lag: the operator waits for it too (runner.wait_for_crd).
    wait_for(lambda: cluster.kubectl("get", "pdservices.pdserve.io", "--all-namespaces"), 60)
    ensure_cpu_node(cluster)


@pytest.fixture(scope="module")
def namespace(cluster: ClusterHelper, crd: None) -> Iterator[str]:
    name = cluster.create_namespace("op")
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def start_operator(
    cluster: ClusterHelper, namespace: str, log_dir: Path, identity: str, *flags: str
) -> OperatorProcess:
    return OperatorProcess(
        cluster.kubeconfig,
        log_dir / f"operator-{identity}.log",
        namespaces=[namespace],
        identity=identity,
        lease_name=f"pdserve-operator-{namespace}",
        lease_namespace=namespace,
        extra=[
            "--resync-seconds",
            "3",
            "--relist-seconds",
            "4",
            "--lease-seconds",
            "6",
            "--renew-deadline",
            "4",
            "--retry-period",
            "1",
            *flags,
        ],
    ).start()


@pytest.fixture(scope="module")
def operator(
    cluster: ClusterHelper, namespace: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    process = start_operator(cluster, namespace, tmp_path_factory.mktemp("operator"), "main")
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def llama(cluster: ClusterHelper, namespace: str, operator: OperatorProcess) -> str:
    """The example PDService, applied once and Available; later tests update it in order."""
    cluster.apply(example("llama", namespace))
    cluster.kubectl(
        "wait", "--for=condition=Available", "pdservices.pdserve.io/llama", f"--namespace={namespace}", "--timeout=120s"
    )
    return "llama"


# -------------------------------------------------------------------------------------------------------- tests


def test_crd_rejects_what_cel_can_check(cluster: ClusterHelper, namespace: str) -> None:
    document = example("cel", namespace)
    document["spec"]["decode"]["autoscaling"] = {"enabled": True, "minReplicas": 5, "maxReplicas": 2}
    proc = cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(document), check=False)
    assert proc.returncode != 0
    assert "minReplicas must be <= maxReplicas" in proc.stderr
    document = example("cel", namespace)
    document["spec"]["prefill"]["tensorParallelSize"] = 4
    proc = cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(document), check=False)
    assert "prefill.tensorParallelSize must be <= decode.tensorParallelSize" in proc.stderr


def test_example_becomes_available_with_rendered_children(
    cluster: ClusterHelper, namespace: str, operator: OperatorProcess, llama: str
) -> None:
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in children(cluster, namespace, llama))
    assert kinds == sorted((o["kind"], o["metadata"]["name"]) for o in rendered(cluster, namespace, llama))
    wait_matches_render(cluster, namespace, llama)
    for obj in children(cluster, namespace, llama):
        refs = obj["metadata"]["ownerReferences"]
        assert [(r["kind"], r["name"], r["controller"]) for r in refs] == [("PDService", llama, True)]

    body = pds_get(cluster, namespace, llama)
    status = body["status"]
    assert status["observedGeneration"] == body["metadata"]["generation"]
    assert status["prefill"] == {"replicas": 2, "readyReplicas": 2, "desiredReplicas": 2}
    assert status["decode"] == {"replicas": 4, "readyReplicas": 4, "desiredReplicas": 4}
    assert status["routerEndpoint"] == f"http://llama-router.{namespace}.svc:8080"
    spec = PDService.model_validate({k: v for k, v in body.items() if k != "status"}).spec
    assert status["kvCompatHash"] == kv_compat_hash(effective(spec))
    assert condition(body, "Degraded")["status"] == "False"
    assert not body["metadata"].get("finalizers")
    assert not [k for k in body["metadata"].get("annotations", {}) if k.startswith("kopf")]

    # Engine pods landed on RDMA-capable H100 nodes, each labelled with the kv-compat hash.
    nodes = {n["metadata"]["name"]: n for n in cluster.get_json("nodes")["items"]}
    engines = cluster.pods(namespace, "pdserve.io/role in (prefill,decode),app.kubernetes.io/instance=llama")
    assert len(engines) == 6
    for pod in engines:
        node = nodes[pod["spec"]["nodeName"]]
        assert node["metadata"]["labels"]["nvidia.com/gpu.product"] == KWOK_PRODUCT
        assert int(node["status"]["allocatable"].get("rdma/ib", "0")) > 0
        assert pod["metadata"]["labels"][KV_COMPAT_LABEL] == status["kvCompatHash"]
    events = cluster.get_json("events", f"--namespace={namespace}", f"--field-selector=involvedObject.name={llama}")
    reasons = {e["reason"] for e in events["items"]}
    assert {"Applied", "Available"} <= reasons


def test_noop_reconcile_writes_nothing(
    cluster: ClusterHelper, namespace: str, operator: OperatorProcess, llama: str
) -> None:
    # Let any trailing status updates settle, then watch several resync passes plus an event-triggered one.
    wait_for(lambda: condition(pds_get(cluster, namespace, llama), "Progressing").get("status") == "False", 60)
    settle(cluster, namespace, operator)
    writes = operator.writes()
    cluster.kubectl("annotate", "pdservices.pdserve.io", llama, f"--namespace={namespace}", "touched=1", "--overwrite")
    wait_resyncs(cluster, namespace, operator, 3)
    assert operator.writes() == writes


def test_update_replicas_image_and_router_settings(
    cluster: ClusterHelper, namespace: str, operator: OperatorProcess, llama: str
) -> None:
    before = pds_get(cluster, namespace, llama)
    old_hash = before["status"]["kvCompatHash"]
    document = example(llama, namespace)
    document["spec"]["decode"]["replicas"] = 3
    document["spec"]["engine"]["image"] = "vllm/vllm-openai:v0.33.0"
    document["spec"]["router"]["routing"]["disaggregationThreshold"] = 1024
    new_spec = PDService.model_validate(document).spec
    new_hash = kv_compat_hash(effective(new_spec))
    expected_hash = {"vllm/vllm-openai:v0.32.0": old_hash, "vllm/vllm-openai:v0.33.0": new_hash}

    # Watch every engine pod throughout the rollout: its kv-compat label must match the image it runs.
    violations: list[str] = []
    stop = threading.Event()

    def watch_pods() -> None:
        while not stop.is_set():
            for pod in cluster.pods(namespace, "pdserve.io/role in (prefill,decode)"):
                image = pod["spec"]["containers"][0]["image"]
                label = pod["metadata"]["labels"].get(KV_COMPAT_LABEL)
                if label != expected_hash.get(image):
                    violations.append(f"{pod['metadata']['name']}: image {image} label {label}")
            time.sleep(0.2)

    watcher = threading.Thread(target=watch_pods, daemon=True)
    watcher.start()
    try:
        cluster.apply(document)

        def converged() -> bool:
            body = pds_get(cluster, namespace, llama)
            status = body.get("status") or {}
            return (
                status.get("observedGeneration") == body["metadata"]["generation"]
                and status.get("kvCompatHash") == new_hash
                and status.get("decode", {}).get("readyReplicas") == 3
                and condition(body, "Available").get("status") == "True"
                and condition(body, "Progressing").get("status") == "False"
            )

        wait_for(converged, 180, interval=1, message="the rollout to finish")
    finally:
        stop.set()
        watcher.join(10)
    assert not violations, violations[:5]
    after = pds_get(cluster, namespace, llama)
    assert after["metadata"]["generation"] > before["metadata"]["generation"]
    assert after["status"]["decode"] == {"replicas": 3, "readyReplicas": 3, "desiredReplicas": 3}
    wait_matches_render(cluster, namespace, llama)
    config = cluster.get_json("configmap", "llama-router", f"--namespace={namespace}")
    assert "disaggregationThresholdTokens: 1024" in config["data"]["router.yaml"]
    pods = cluster.pods(namespace, "pdserve.io/role in (prefill,decode)")
    assert {p["metadata"]["labels"][KV_COMPAT_LABEL] for p in pods} == {new_hash}


def test_drift_is_restored(cluster: ClusterHelper, namespace: str, operator: OperatorProcess, llama: str) -> None:
    service = cluster.get_json("service", "llama-router", f"--namespace={namespace}")
    cluster.kubectl("delete", "service", "llama-router", f"--namespace={namespace}")
    restored = wait_for(
        lambda: (
            (s := cluster.get_json("service", "llama-router", f"--namespace={namespace}"))["metadata"]["uid"]
            != service["metadata"]["uid"]
            and s
        ),
        30,
    )
    assert restored["spec"]["ports"][0]["port"] == 8080

    patch = {"spec": {"template": {"spec": {"containers": [{"name": "vllm", "image": "evil:latest"}]}}}}
    cluster.kubectl("patch", "statefulset", "llama-prefill", f"--namespace={namespace}", "-p", json.dumps(patch))

    def image() -> str:
        sts = cluster.get_json("statefulset", "llama-prefill", f"--namespace={namespace}")
        return str(sts["spec"]["template"]["spec"]["containers"][0]["image"])

    wait_for(lambda: image() != "evil:latest", 30, message="the StatefulSet template to be restored")
    wait_matches_render(cluster, namespace, llama)


def test_empty_string_fields_settle(cluster: ClusterHelper, namespace: str, operator: OperatorProcess) -> None:
    """An env var with value "" and a toleration with key "" come back from the API server without those fields
    (omitempty). The operator must not take that for drift: the PDService settles and further passes write nothing."""
    document = example("blank", namespace)
    document["spec"]["engine"]["env"] = [{"name": "EMPTY", "value": ""}]
    document["spec"]["placement"]["tolerations"] = [{"key": "", "operator": "Exists"}]
    cluster.apply(document)
    try:
        cluster.kubectl(
            "wait",
            "--for=condition=Available",
            "pdservices.pdserve.io/blank",
            f"--namespace={namespace}",
            "--timeout=120s",
        )
        wait_for(
            lambda: condition(pds_get(cluster, namespace, "blank"), "Progressing").get("status") == "False",
            60,
            message="Progressing to become False",
        )
        # Mistaking the omitted fields for drift would re-apply on every pass and never settle.
        settle(cluster, namespace, operator)
        writes = operator.writes()
        wait_resyncs(cluster, namespace, operator, 3)
        assert operator.writes() == writes
    finally:
        cluster.kubectl("delete", "pdservices.pdserve.io", "blank", f"--namespace={namespace}")


def test_owned_leftovers_are_pruned_and_foreign_objects_kept(
    cluster: ClusterHelper, namespace: str, operator: OperatorProcess, llama: str
) -> None:
    uid = pds_get(cluster, namespace, llama)["metadata"]["uid"]
    labels = {"app.kubernetes.io/instance": llama, "app.kubernetes.io/managed-by": "pdserve-operator"}
    owner = {"apiVersion": "pdserve.io/v1alpha1", "kind": "PDService", "name": llama, "uid": uid, "controller": True}

    def config_map(name: str, owners: list[dict[str, Any]]) -> dict[str, Any]:
        meta = {"name": name, "namespace": namespace, "labels": labels, "ownerReferences": owners}
        return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {"k": "v"}}

    # A child an older render produced (controlled by this PDService) and an object someone else owns.
    cluster.apply([config_map("llama-leftover", [owner]), config_map("llama-foreign", [])])
    wait_for(
        lambda: (
            cluster.kubectl("get", "configmap", "llama-leftover", f"--namespace={namespace}", check=False).returncode
        ),
        30,
        message="the leftover ConfigMap to be pruned",
    )
    wait_resyncs(cluster, namespace, operator, 2)  # passes after the prune that saw the foreign object too
    assert cluster.kubectl("get", "configmap", "llama-foreign", f"--namespace={namespace}", check=False).returncode == 0
    events = cluster.get_json("events", f"--namespace={namespace}", f"--field-selector=involvedObject.name={llama}")
    assert any(e["reason"] == "Pruned" and "llama-leftover" in e["message"] for e in events["items"])
    cluster.kubectl("delete", "configmap", "llama-foreign", f"--namespace={namespace}")


def test_invalid_spec_is_reported_and_children_untouched(
    cluster: ClusterHelper, namespace: str, operator: OperatorProcess, llama: str
) -> None:
    wait_for(lambda: condition(pds_get(cluster, namespace, llama), "Progressing").get("status") == "False", 60)
    versions = {
        (o["kind"], o["metadata"]["name"]): o["metadata"]["resourceVersion"]
        for o in children(cluster, namespace, llama)
    }
    good = pds_get(cluster, namespace, llama)
    broken = copy.deepcopy({k: v for k, v in good.items() if k in ("apiVersion", "kind", "spec")})
    broken["metadata"] = {"name": llama, "namespace": namespace}
    broken["spec"]["prefill"].update(tensorParallelSize=2, gpusPerPod=1)
    broken["spec"]["decode"]["tensorParallelSize"] = 2
    cluster.apply(broken)  # passes the CRD: only pdserve's validation knows gpusPerPod must cover TP

    def degraded() -> dict[str, Any] | None:
        body = pds_get(cluster, namespace, llama)
        item = condition(body, "Degraded")
        ok = (
            item.get("reason") == "InvalidSpec"
            and body["status"]["observedGeneration"] == body["metadata"]["generation"]
        )
        return item if ok else None

    item = wait_for(degraded, 30)
    assert item["status"] == "True"
    assert "spec.prefill.gpusPerPod" in item["message"]

    def invalid_spec_event() -> bool:
        events = cluster.get_json("events", f"--namespace={namespace}", f"--field-selector=involvedObject.name={llama}")
        return any(e["reason"] == "InvalidSpec" and e["type"] == "Warning" for e in events["items"])

    # The event is the pass's last write (after the status): once it is visible, the pass's writes are counted.
    wait_for(invalid_spec_event, 30, message="the InvalidSpec event")
    # No retry storm: over several passes that each find the spec invalid, the operator writes nothing more.
    writes = operator.writes()
    operator.wait_reconciles(3, result="invalid")
    assert operator.writes() == writes
    after = {
        (o["kind"], o["metadata"]["name"]): o["metadata"]["resourceVersion"]
        for o in children(cluster, namespace, llama)
    }
    workloads = {k: v for k, v in after.items() if k[0] in ("StatefulSet", "Deployment", "ConfigMap", "Service")}
    assert workloads == {k: v for k, v in versions.items() if k in workloads}

    # Fixing the spec recovers.
    fixed = copy.deepcopy(broken)
    fixed["spec"]["prefill"]["gpusPerPod"] = 2
    cluster.apply(fixed)
    wait_for(lambda: condition(pds_get(cluster, namespace, llama), "Degraded").get("reason") == "AsExpected", 60)


def test_node_paths_are_refused_unless_the_operator_allows_them(
    cluster: ClusterHelper, namespace: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    document = example("nodepath", namespace)
    document["spec"]["model"] = {"name": "weights", "uri": "/mnt/models/weights"}
    cluster.apply(document)  # the CRD admits it: a normalised path clear of every system path

    def degraded() -> dict[str, Any] | None:
        item = condition(pds_get(cluster, namespace, "nodepath"), "Degraded")
        return item if item.get("reason") == "InvalidSpec" else None

    item = wait_for(degraded, 30)
    assert "spec.model.uri" in item["message"] and "--allow-model-host-paths" in item["message"]
    assert not [o for o in children(cluster, namespace, "nodepath") if o["kind"] == "StatefulSet"]

    # An operator whose administrator allows /mnt/models renders the hostPath volume.
    allowed = cluster.create_namespace("op-paths")
    other = start_operator(cluster, allowed, tmp_path, "paths", "--allow-model-host-paths", "/mnt/models")
    try:
        other.wait_ready()
        document["metadata"]["namespace"] = allowed
        cluster.apply(document)

        def statefulset() -> dict[str, Any] | None:
            found = [o for o in children(cluster, allowed, "nodepath") if o["kind"] == "StatefulSet"]
            return found[0] if found else None

        volumes = wait_for(statefulset, 60)["spec"]["template"]["spec"]["volumes"]
        assert {"name": "model", "hostPath": {"path": "/mnt/models/weights", "type": "Directory"}} in volumes
        assert condition(pds_get(cluster, allowed, "nodepath"), "Degraded").get("reason") != "InvalidSpec"
    finally:
        other.stop()
        cluster.kubectl("delete", "namespace", allowed, "--wait=false", check=False)
        cluster.kubectl("delete", "pdservices.pdserve.io", "nodepath", f"--namespace={namespace}", check=False)


def test_impossible_placement_reports_the_scheduler_message(
    cluster: ClusterHelper, namespace: str, operator: OperatorProcess
) -> None:
    document = example("huge", namespace)
    document["spec"]["prefill"].update(replicas=1, gpusPerPod=16)  # nodes have 8 GPUs
    cluster.apply(document)

    def pending() -> dict[str, Any] | None:
        item = condition(pds_get(cluster, namespace, "huge"), "Degraded")
        return item if item.get("reason") == "PodsPending" else None

    item = wait_for(pending, 60)
    assert item["status"] == "True"
    assert "huge-prefill-0" in item["message"]
    assert "Insufficient nvidia.com/gpu" in item["message"]
    assert condition(pds_get(cluster, namespace, "huge"), "Available")["status"] == "False"
    cluster.kubectl("delete", "pdservices.pdserve.io", "huge", f"--namespace={namespace}")


def test_delete_garbage_collects_children(cluster: ClusterHelper, namespace: str, operator: OperatorProcess) -> None:
    cluster.apply(example("gone", namespace))
    wait_for(lambda: len(children(cluster, namespace, "gone")) == len(rendered(cluster, namespace, "gone")), 60)
    cluster.kubectl("delete", "pdservices.pdserve.io", "gone", f"--namespace={namespace}")
    wait_for(lambda: not children(cluster, namespace, "gone"), 90, interval=1, message="garbage collection")


def test_restart_mid_reconcile_converges_without_duplicates(cluster: ClusterHelper, crd: None, tmp_path: Path) -> None:
    namespace = cluster.create_namespace("op-restart")
    try:
        first = start_operator(cluster, namespace, tmp_path, "first")
        first.wait_ready()
        api = KubeApi(new_api_client(cluster.kubeconfig))
        first_child = SERVICE_ACCOUNT.object_path(namespace, "restart-router")
        cluster.apply(example("restart", namespace))
        # SIGKILL it the moment the first child exists: the pass is cut short, the workloads usually not applied.
        wait_for(lambda: api.get(first_child, "ServiceAccount"), 30, interval=0.002)
        first.kill()
        partial = len(children(cluster, namespace, "restart"))
        # A change made while no operator runs must not be lost either.
        document = example("restart", namespace)
        document["spec"]["decode"]["replicas"] = 3
        cluster.apply(document)
        second = start_operator(cluster, namespace, tmp_path, "second")
        try:
            second.wait_ready(timeout=60)
            cluster.kubectl(
                "wait",
                "--for=condition=Available",
                "pdservices.pdserve.io/restart",
                f"--namespace={namespace}",
                "--timeout=120s",
            )
            objects = children(cluster, namespace, "restart")
            names = [(o["kind"], o["metadata"]["name"]) for o in objects]
            assert len(names) == len(set(names)) == len(rendered(cluster, namespace, "restart"))
            wait_matches_render(cluster, namespace, "restart")
            assert partial <= len(names)

            def caught_up() -> bool:
                body = pds_get(cluster, namespace, "restart")
                status = body.get("status") or {}
                return bool(
                    status.get("observedGeneration") == body["metadata"]["generation"]
                    and status.get("decode", {}).get("readyReplicas") == 3
                )

            wait_for(caught_up, 60)
        finally:
            second.stop()
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_a_starting_controller_lists_the_children_before_its_first_pass(
    cluster: ClusterHelper, crd: None, tmp_path: Path
) -> None:
    """The PDService's watch event may come before any child's (kopf watches each kind on its own): the first pass
    must still see the children that exist, not "create" them over what an external autoscaler set (the chaos
    benchmark's restarted operator reset both pools that way). The controller runs in this process against the
    real API server, fed the owner's event and nothing else, which is that race at its worst."""
    namespace = cluster.create_namespace("op-sync")
    try:
        document = example("sync", namespace)
        document["spec"]["decode"]["autoscaling"] = {"enabled": True, "mode": "external", "minReplicas": 1}
        first = start_operator(cluster, namespace, tmp_path, "first")
        try:
            first.wait_ready()
            cluster.apply(document)
            cluster.kubectl(
                "wait",
                "--for=condition=Available",
                "pdservices.pdserve.io/sync",
                f"--namespace={namespace}",
                "--timeout=120s",
            )
            cluster.kubectl("scale", "statefulset/sync-decode", "--replicas=2", f"--namespace={namespace}")
        finally:
            first.stop()
        owner = pds_get(cluster, namespace, "sync")
        api = KubeApi(new_api_client(cluster.kubeconfig))
        metrics = OperatorMetrics()
        defaults = OperatorSettings()
        controller = Controller(
            api,
            views=SpecViews(DEFAULT_POLICY),
            workers=defaults.workers,
            resync_seconds=3600,
            relist_seconds=defaults.relist_seconds,
            crash_window=defaults.crash_recovery_seconds,
            namespaces=[namespace],
            metrics=metrics,
        )

        def passes() -> float:
            return sum(
                sample.value
                for family in metrics.registry.collect()
                if family.name == "pdserve_operator_reconciles"
                for sample in family.samples
                if sample.name.endswith("_total")
            )

        async def counted() -> bool:
            return passes() >= 1

        async def first_pass() -> None:
            stop = asyncio.Event()
            controller.on_owner_event({"type": "ADDED", "object": owner})
            task = asyncio.create_task(controller.run(stop))
            try:
                await wait_for_async(counted, within=60, message="the first pass")
            finally:
                stop.set()
                await task

        asyncio.run(first_pass())
        assert controller.synced.is_set()
        assert not [write for write in api.writes if write.startswith("apply ")], api.writes
        replicas = cluster.get_json("statefulset", "sync-decode", f"--namespace={namespace}")["spec"]["replicas"]
        assert replicas == 2
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_two_replicas_only_one_acts(cluster: ClusterHelper, crd: None, tmp_path: Path) -> None:
    namespace = cluster.create_namespace("op-ha")
    a = start_operator(cluster, namespace, tmp_path, "a")
    b = start_operator(cluster, namespace, tmp_path, "b")
    try:
        wait_for(lambda: a.is_leader() or b.is_leader(), 30)
        leader, follower = (a, b) if a.is_leader() else (b, a)
        follower.wait_ready(leader=False)
        cluster.apply(example("ha", namespace))
        cluster.kubectl(
            "wait",
            "--for=condition=Available",
            "pdservices.pdserve.io/ha",
            f"--namespace={namespace}",
            "--timeout=120s",
        )
        assert leader.writes() > 0
        assert follower.writes() == 0
        assert not follower.is_leader()

        # The leader dies without releasing the lease: the follower takes over after the lease expires and acts.
        leader.kill()
        follower.wait_ready(timeout=30, leader=True)
        document = example("ha", namespace)
        document["spec"]["decode"]["replicas"] = 2
        cluster.apply(document)
        wait_for(lambda: pds_get(cluster, namespace, "ha")["status"]["decode"]["readyReplicas"] == 2, 60)
        assert follower.writes() > 0
    finally:
        a.stop()
        b.stop()
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
