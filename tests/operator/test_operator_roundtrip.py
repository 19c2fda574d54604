"""Every rendered object, applied to a real API server, reads back without drift (cluster tier).

The drift check (`drift.apply_reason`) must accept what the API server does to an object between apply and read
back: defaulting, quantity canonicalisation, `omitempty` dropping empty values. If it did not, every pass would
re-apply the object, post an event and keep Progressing=True. This applies the render of specs that use every
optional field, and checks the apply response (what the operator caches) and a fresh read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.api.kubeclient import new_api_client
from pdserve.api.validation import validate
from pdserve_dev.testing.cluster import ClusterHelper
from pdserve_dev.testing.examples import POLICY
from pdserve_operator import drift
from pdserve_operator.kinds import kind_of
from pdserve_operator.kube import KubeApi
from pdserve_operator.render import render

pytestmark = [pytest.mark.cluster]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def everything(namespace: str) -> dict[str, Any]:
    """The example with every optional field set, in the spellings users write."""
    document: dict[str, Any] = yaml.safe_load((EXAMPLES / "pdservice.yaml").read_text())
    document["metadata"] = {"name": "everything", "namespace": namespace}
    spec = document["spec"]
    spec["engine"].update(
        imagePullPolicy="IfNotPresent",
        kvBufferDevice="cpu",
        kvLeaseSeconds=60,
        kvLoadFailurePolicy="recompute",
        port=8001,
        sideChannelPort=5601,
        shmSize="1.5Gi",
        runAsUser=1000,
        ucx={"transports": "rc", "netDevices": "mlx5_0:1"},
        env=[
            {"name": "EMPTY", "value": ""},
            {"name": "PLAIN", "value": "1"},
            {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "CPUS", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu", "divisor": "1m"}}},
        ],
    )
    spec["prefill"].update(
        dataParallelSize=2,
        gpusPerPod=2,
        rdma={"resourceName": "rdma/ib", "count": 2},
        resources={"requests": {"cpu": "0.5", "memory": "1e9"}, "limits": {"cpu": "1000m", "memory": "2048Mi"}},
        nodeSelector={"pool": "prefill", "empty": ""},
        tolerations=[
            {"key": "", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 0},
            {"key": "k", "operator": "Equal", "value": "", "effect": "NoSchedule"},
        ],
        maxUnavailable=0,
        env=[{"name": "PLAIN", "value": "2"}],
    )
    spec["decode"]["autoscaling"] = {"enabled": True, "minReplicas": 0, "maxReplicas": 3}
    spec["placement"].update(rdma="preferred", colocation="required", maxSkew=2, tolerations=[])
    spec["router"].update(
        replicas=0,
        image="example.com/pdserve:dev",
        serviceType="NodePort",
        resources={"requests": {"cpu": "100m"}, "limits": {"memory": "0.5Gi"}},
        nodeSelector={"kubernetes.io/os": "linux"},
        tolerations=[{"operator": "Exists"}],
    )
    return document


def variants(namespace: str) -> list[dict[str, Any]]:
    out = [everything(namespace)]
    for path in sorted(EXAMPLES.glob("*.yaml")):
        if path.stem == "invalid":
            continue
        for document in yaml.safe_load_all(path.read_text()):
            document["metadata"]["namespace"] = namespace
            out.append(document)
    return out


def test_rendered_objects_read_back_without_drift(cluster: ClusterHelper) -> None:
    namespace = cluster.create_namespace("roundtrip")
    api = KubeApi(new_api_client(cluster.kubeconfig))
    try:
        drifted = []
        for document in variants(namespace):
            for obj in render(validate(document, POLICY)):
                stamped = drift.stamp(obj)
                label = f"{document['metadata']['name']}: {obj['kind']} {obj['metadata']['name']}"
                response = api.apply(stamped)
                reread = api.get(kind_of(obj).object_path(namespace, obj["metadata"]["name"]), obj["kind"])
                for source, observed in (("apply response", response), ("read", reread)):
                    reason = drift.apply_reason(stamped, observed)
                    if reason is not None:
                        drifted.append(f"{label} ({source}): {reason}")
        assert drifted == []
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
