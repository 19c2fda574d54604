"""Every example in examples/ reaches Available on the local cluster's default topology, as a user would apply it;
examples/invalid.yaml is refused by the API server.

Each example goes into a namespace of its own (examples name `default` or `inference`); one operator process
watches them all. The engines of every example but local-sim are kwok pods on the GPU product the example asks
for (H100, H200, GB200), their routers kwok pods on the CPU nodes; local-sim runs for real on the process node.
What a user of the example must provide is provided the way they would: the `inference` namespace's model claim
(a bound PersistentVolume) for pvc-heterogeneous-tp.yaml, and the administrator's permission for node paths under
/mnt/models (`--allow-model-host-paths`, the chart's `operator.allowModelHostPaths`) for mla-hostpath-tcp.yaml.
The gated model's `hf-token` Secret of pdservice.yaml is not needed to schedule (the engines read it at start), so
it is left out as a user might forget it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.api.crdgen import custom_resource_definition
from pdserve_dev.testing.cluster import ClusterHelper
from pdserve_dev.testing.operator import OperatorProcess
from pdserve_dev.testing.wait import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.yaml") if p.stem != "invalid")
# The GPU products each example's engines may land on (None: the process node). The examples that name a product
# land on it; kv-store, minimal and mla-hostpath-tcp name none, so any GPU node will do, and which one depends on
# what the other examples took first (the scheduler spread kv-store's engines over H100 and GB200 once).
ANY_GPU: set[str | None] = {"NVIDIA-H100-80GB-HBM3", "NVIDIA-H200", "NVIDIA-GB200"}
PRODUCTS: dict[str, set[str | None]] = {
    "kv-store": ANY_GPU,
    "local-sim": {None},
    "minimal": ANY_GPU,
    "mla-hostpath-tcp": ANY_GPU,
    "pdservice": {"NVIDIA-H200"},
    "pvc-heterogeneous-tp": {"NVIDIA-GB200"},
}


def _document(path: Path) -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(path.read_text())
    return document


@pytest.fixture(scope="module")
def namespaces(cluster: ClusterHelper) -> Iterator[dict[str, str]]:
    text = yaml.safe_dump(custom_resource_definition())
    wait_for(lambda: cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=text), 60)
    cluster.wait_crd_established()
    names = {path.stem: cluster.create_namespace("example") for path in EXAMPLES}
    yield names
    for name in names.values():
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def _model_claim(namespace: str, claim: str) -> list[dict[str, Any]]:
    """A claim and the pre-provisioned volume it binds to (what a cluster admin gives the `inference` team)."""
    volume = f"{namespace}-{claim}"
    access = {"accessModes": ["ReadOnlyMany"], "storageClassName": ""}
    return [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": volume},
            "spec": {
                **access,
                "capacity": {"storage": "200Gi"},
                "hostPath": {"path": "/mnt/models"},
                "claimRef": {"namespace": namespace, "name": claim},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim, "namespace": namespace},
            "spec": {**access, "resources": {"requests": {"storage": "200Gi"}}, "volumeName": volume},
        },
    ]


def test_every_example_reaches_available(cluster: ClusterHelper, namespaces: dict[str, str], tmp_path: Path) -> None:
    assert set(namespaces) == set(PRODUCTS), "an example was added or renamed: give it its GPU product here"
    claim = _document(ROOT / "examples" / "pvc-heterogeneous-tp.yaml")["spec"]["model"]["uri"].split("/")[2]
    pvc_namespace = namespaces["pvc-heterogeneous-tp"]
    cluster.apply(_model_claim(pvc_namespace, claim))
    wait_for(
        lambda: cluster.get_json("pvc", claim, f"--namespace={pvc_namespace}")["status"].get("phase") == "Bound",
        60,
        message="the model claim to bind",
    )
    with OperatorProcess(
        cluster.kubeconfig,
        tmp_path / "operator.log",
        namespaces=list(namespaces.values()),
        identity="examples",
        extra=["--allow-model-host-paths", "/mnt/models"],
    ) as operator:
        operator.wait_ready()
        for path in EXAMPLES:
            document = _document(path)
            document["metadata"]["namespace"] = namespaces[path.stem]
            cluster.apply(document)
        for stem, namespace in namespaces.items():
            name = _document(ROOT / "examples" / f"{stem}.yaml")["metadata"]["name"]
            result = cluster.kubectl(
                "wait", "--for=condition=Available", f"pdservices.pdserve.io/{name}", f"--namespace={namespace}",
                "--timeout=120s", timeout=140, check=False,
            )  # fmt: skip
            status = cluster.get_json("pdservices.pdserve.io", name, f"--namespace={namespace}").get("status", {})
            assert result.returncode == 0, f"{stem}: {status.get('conditions')}\n{operator.log_tail(30)}"
    nodes = {n["metadata"]["name"]: n["metadata"]["labels"] for n in cluster.get_json("nodes")["items"]}
    for stem, product in PRODUCTS.items():
        engines = cluster.pods(namespaces[stem], "pdserve.io/role in (prefill,decode)")
        placed = {nodes[p["spec"]["nodeName"]].get("nvidia.com/gpu.product") for p in engines}
        assert placed and placed <= product, f"{stem}: engines on {placed}"


def test_invalid_example_is_refused_with_its_problems(cluster: ClusterHelper, namespaces: dict[str, str]) -> None:
    document = _document(ROOT / "examples" / "invalid.yaml")
    document["metadata"]["namespace"] = namespaces["minimal"]
    result = cluster.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump(document), check=False)
    assert result.returncode != 0
    assert "is invalid" in result.stderr and "spec.decode" in result.stderr, result.stderr
