"""The autoscaler's wiring against the real API server: who owns a pool's replicas, and what status says.

The operator runs as a `pdserve operator` process on the local cluster's kwok GPU nodes (pods become Ready but
serve nothing, so the real Prometheus has no metrics of them: every decision is the fail-static hold). That is the
point here: ownership of `spec.replicas` between the operator's server-side apply, the autoscaler's /scale writes
and an external scaler's, as the real API server settles it, without engines. Scaling on real metrics is
tests/e2e/test_e2e_autoscaling.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.api.crdgen import custom_resource_definition
from pdserve_dev.testing.cluster import ClusterHelper
from pdserve_dev.testing.operator import OperatorProcess, ensure_cpu_node
from pdserve_dev.testing.prometheus import PrometheusHelper
from pdserve_dev.testing.wait import wait_for
from pdserve_operator.kinds import CONFIG_MAP, STATEFUL_SET
from pdserve_operator.kube import AUTOSCALER_FIELD_MANAGER, FIELD_MANAGER, ApiError, KubeApi

pytestmark = [pytest.mark.cluster]

ROOT = Path(__file__).resolve().parents[3]
KWOK_PRODUCT = "NVIDIA-H100-80GB-HBM3"


def example(name: str, namespace: str, **pools: dict[str, Any]) -> dict[str, Any]:
    """examples/pdservice.yaml on the kwok topology, with small pools and the given per-pool autoscaling."""
    document: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "pdservice.yaml").read_text())
    document["metadata"] = {"name": name, "namespace": namespace}
    document["spec"]["placement"]["gpuNodeSelector"] = {"nvidia.com/gpu.product": KWOK_PRODUCT}
    del document["spec"]["model"]["hfTokenSecret"]
    for role in ("prefill", "decode"):
        document["spec"][role]["replicas"] = 1
        document["spec"][role]["autoscaling"] = pools.get(role, {"enabled": False})
    return document


def get(cluster: ClusterHelper, namespace: str, *args: str) -> dict[str, Any]:
    result: dict[str, Any] = cluster.get_json(*args, f"--namespace={namespace}")
    return result


def condition(body: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((dict(c) for c in (body.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def replicas_owners(sts: dict[str, Any]) -> set[str]:
    """Field managers that own the StatefulSet's spec.replicas."""
    return {
        entry["manager"]
        for entry in sts["metadata"].get("managedFields") or []
        if "f:replicas" in ((entry.get("fieldsV1") or {}).get("f:spec") or {})
    }


@pytest.fixture(scope="module")
def namespace(cluster: ClusterHelper) -> Iterator[str]:
    text = yaml.safe_dump(custom_resource_definition())
    wait_for(lambda: cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=text), 60)
    cluster.wait_crd_established()
    ensure_cpu_node(cluster)
    name = cluster.create_namespace("scale")
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def operator(cluster: ClusterHelper, namespace: str, log: Path, *flags: str) -> OperatorProcess:
    return OperatorProcess(
        cluster.kubeconfig,
        log,
        namespaces=[namespace],
        identity=log.stem,
        lease_name=f"op-{log.stem}",
        lease_namespace=namespace,
        extra=["--resync-seconds", "2", "--autoscaler-interval-seconds", "1", *flags],
    )


def test_apply_with_a_stale_resource_version_is_refused(cluster: ClusterHelper, namespace: str) -> None:
    """What the planner relies on so that a stale cache never undoes a /scale write: server-side apply honours
    `metadata.resourceVersion` as a precondition."""
    with cluster.api_client() as client:
        api = KubeApi(client)
        metadata = {"name": "precondition", "namespace": namespace}
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": {"a": "1"}}
        first = api.apply(body)
        api.apply({**body, "data": {"a": "2"}})
        stale = {**body, "metadata": {**metadata, "resourceVersion": first["metadata"]["resourceVersion"]}}
        with pytest.raises(ApiError) as refused:
            api.apply({**stale, "data": {"a": "3"}})
        assert refused.value.code == 409
        current = api.get(CONFIG_MAP.object_path(namespace, "precondition"), "ConfigMap")
        assert current["data"] == {"a": "2"}


def test_without_prometheus_pools_hold_and_say_so(cluster: ClusterHelper, namespace: str, tmp_path: Path) -> None:
    with operator(cluster, namespace, tmp_path / "noprom.log") as op:
        op.wait_ready()
        scaled = {"enabled": True, "minReplicas": 1, "maxReplicas": 3}
        cluster.apply(example("noprom", namespace, prefill=scaled))

        def holding() -> dict[str, Any] | None:
            body = get(cluster, namespace, "pdservices.pdserve.io", "noprom")
            return body if condition(body, "ScalingActive").get("reason") == "PrometheusNotConfigured" else None

        body = wait_for(holding, 60, message=lambda: op.log_tail(20))
    assert condition(body, "ScalingActive")["status"] == "False"
    assert "--prometheus-url" in condition(body, "ScalingActive")["message"]
    assert body["status"]["prefill"]["autoscaling"]["reason"] == "PrometheusNotConfigured"
    events = get(cluster, namespace, "events", "--field-selector=involvedObject.name=noprom")["items"]
    assert any(e["reason"] == "PrometheusNotConfigured" and e["type"] == "Warning" for e in events)
    wide = cluster.kubectl("get", "pds", "noprom", f"--namespace={namespace}", "-o", "wide").stdout
    assert "PREFILL-SCALING" in wide and "PrometheusNotConfigured" in wide


def test_the_threshold_bounds_publish_a_router_control_the_operator_owns(
    cluster: ClusterHelper, namespace: str, tmp_path: Path
) -> None:
    """Bounds on the disaggregation threshold make the operator publish the threshold in the router control
    ConfigMap (its child: an edit is undone, and removing the bounds withdraws the threshold) and report the
    threshold in status, which the CRD's schema keeps (an unknown status field would be pruned by the API server),
    and in `kubectl get pds -o wide`. No Prometheus here, so nothing is decided: the configured 512 kept within the
    bounds, 1024."""
    name = "bounds"
    document = example(name, namespace, prefill={"enabled": True, "minReplicas": 1, "maxReplicas": 2})
    document["spec"]["autoscaling"] = {"disaggregationThreshold": {"minTokens": 1024, "maxTokens": 8192}}
    control = f"{name}-router-control"

    def published() -> int | None:
        found = cluster.kubectl("get", "configmap", control, f"--namespace={namespace}", "-o", "json", check=False)
        if found.returncode != 0:
            return None
        threshold = json.loads(json.loads(found.stdout)["data"]["control.json"]).get("disaggregationThreshold")
        return None if threshold is None else int(threshold)

    with operator(cluster, namespace, tmp_path / "bounds.log") as op:
        op.wait_ready()
        cluster.apply(document)
        assert wait_for(published, 60, message=lambda: op.log_tail(20)) == 1024
        config_map = get(cluster, namespace, "configmap", control)
        [owner] = config_map["metadata"]["ownerReferences"]
        body = get(cluster, namespace, "pdservices.pdserve.io", name)
        assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
            "PDService", name, body["metadata"]["uid"], True,
        )  # fmt: skip

        def reported() -> dict[str, Any] | None:
            status = get(cluster, namespace, "pdservices.pdserve.io", name).get("status") or {}
            return status.get("disaggregationThreshold")

        threshold = wait_for(reported, 60, message=lambda: op.log_tail(20))
        assert (threshold["tokens"], threshold["minTokens"], threshold["maxTokens"]) == (1024, 1024, 8192)
        assert threshold["reason"] == "Configured"
        wide = cluster.kubectl("get", "pds", name, f"--namespace={namespace}", "-o", "wide").stdout
        header, row = wide.splitlines()[:2]
        assert row[header.index("PD-THRESHOLD") :].split()[0] == "1024", wide  # kubectl aligns its columns
        # Someone with ConfigMap rights in the namespace edits it: the operator puts it back.
        edited = json.dumps({"data": {"control.json": json.dumps({"disaggregationThreshold": 1})}})
        cluster.kubectl("patch", "configmap", control, f"--namespace={namespace}", "--type=merge", f"--patch={edited}")
        wait_for(lambda: published() == 1024, 60, message=lambda: op.log_tail(20))
        # The bounds removed: no threshold is published (the routers use their configured one; the ConfigMap, there
        # for the SLO's TTFT target, stays), nothing reported.
        unbound = json.dumps({"spec": {"autoscaling": None}})
        cluster.kubectl("patch", "pds", name, f"--namespace={namespace}", "--type=merge", f"--patch={unbound}")
        wait_for(lambda: published() is None, 60, message=lambda: op.log_tail(20))
        wait_for(lambda: reported() is None, 60, message=lambda: op.log_tail(20))


def test_each_pool_keeps_the_replicas_its_owner_wrote(
    cluster: ClusterHelper, namespace: str, prometheus: PrometheusHelper, tmp_path: Path
) -> None:
    """Prefill is scaled by pdserve, decode by an external scaler. With the autoscaler running (its decisions are
    fail-static holds here: kwok pods have no metrics), a write to each pool's /scale survives the operator's
    re-apply of both StatefulSets, even one beyond the spec's bounds for the external pool."""
    name = "owners"
    prefill = {"enabled": True, "minReplicas": 1, "maxReplicas": 3}
    decode = {"enabled": True, "mode": "external", "minReplicas": 1, "maxReplicas": 2}
    with operator(cluster, namespace, tmp_path / "owners.log", f"--prometheus-url={prometheus.url}") as op:
        op.wait_ready()
        cluster.apply(example(name, namespace, prefill=prefill, decode=decode))
        cluster.kubectl(
            "wait", "--for=condition=Available", f"pds/{name}", f"--namespace={namespace}", "--timeout=120s"
        )

        def blind() -> dict[str, Any] | None:
            body = get(cluster, namespace, "pdservices.pdserve.io", name)
            return body if condition(body, "ScalingActive").get("reason") == "MetricsUnavailable" else None

        wait_for(blind, 60, message=lambda: op.log_tail(20))

        # The autoscaler's own write (its actuator's call, as it makes it) and an HPA's (kubectl scale patches
        # the same subresource under its own manager).
        with cluster.api_client() as client:
            KubeApi(client).scale(STATEFUL_SET, namespace, f"{name}-prefill", 3)
        cluster.kubectl("scale", f"statefulset/{name}-decode", "--replicas=5", f"--namespace={namespace}")
        # A spec change: the operator re-applies both StatefulSets (their pod templates change).
        changed = example(name, namespace, prefill=prefill, decode=decode)
        for role in ("prefill", "decode"):
            changed["spec"][role]["env"] = [{"name": "CHANGED", "value": "1"}]
        cluster.apply(changed)

        def reapplied() -> bool:
            for role in ("prefill", "decode"):
                sts = get(cluster, namespace, "statefulset", f"{name}-{role}")
                env = sts["spec"]["template"]["spec"]["containers"][0].get("env") or []
                if {"name": "CHANGED", "value": "1"} not in env:
                    return False
            return True

        wait_for(reapplied, 60, message=lambda: op.log_tail(20))
        # The counted event before asserting that nothing moved them back: more reconcile passes and autoscaler
        # decisions for both pools after the re-apply.
        decided = 'pdserve_autoscaler_decisions_total{namespace="%s",pdservice="%s",pool="decode",reason="%s"}'
        key = decided % (namespace, name, "ExternallyScaled")
        before = op.metrics().get(key, 0.0)
        op.wait_reconciles(4)
        wait_for(lambda: op.metrics().get(key, 0.0) >= before + 3, 30)

        prefill_sts = get(cluster, namespace, "statefulset", f"{name}-prefill", "--show-managed-fields")
        decode_sts = get(cluster, namespace, "statefulset", f"{name}-decode", "--show-managed-fields")
        body = get(cluster, namespace, "pdservices.pdserve.io", name)
        events = get(cluster, namespace, "events", f"--field-selector=involvedObject.name={name}")["items"]
        wide = cluster.kubectl("get", "pds", name, f"--namespace={namespace}", "-o", "wide").stdout
        log = op.log_tail(400)

    assert prefill_sts["spec"]["replicas"] == 3
    assert AUTOSCALER_FIELD_MANAGER in replicas_owners(prefill_sts)
    assert decode_sts["spec"]["replicas"] == 5  # beyond maxReplicas 2: the external scaler's bounds are its own
    assert FIELD_MANAGER in replicas_owners(decode_sts)  # co-owned, never changed
    assert replicas_owners(decode_sts) - {FIELD_MANAGER}  # and the external scaler's manager
    external = body["status"]["decode"]["autoscaling"]
    assert (external["mode"], external["reason"], external["currentReplicas"]) == ("external", "ExternallyScaled", 5)
    blind_pool = body["status"]["prefill"]["autoscaling"]
    assert (blind_pool["reason"], blind_pool["currentReplicas"], blind_pool["desiredReplicas"]) == (
        "MetricsUnavailable",
        3,
        3,
    )
    assert condition(body, "ScalingActive")["status"] == "False"
    assert not [e for e in events if e["reason"] == "Scaled"], json.dumps(events)[:2000]
    assert "ExternallyScaled" in wide and "MetricsUnavailable" in wide
    assert "Traceback" not in log, log
