"""`helm install`, `helm upgrade`, `helm uninstall` and a second `helm install` on a local cluster of its own,
with exactly the commands the README gives users, and what each does to the CRD and to running PDServices.

A cluster of its own (minimal topology plus the process node) because the release owns the CRD here, the upgrade
changes it and the last step deletes it: the session cluster's other tests rely on the CRD staying put.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.api.crdgen import custom_resource_definition
from pdserve_dev.cluster.cluster import SYSTEM_NAMESPACE, LocalCluster
from pdserve_dev.testing.cluster import ClusterHelper
from pdserve_dev.testing.wait import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "pdserve"
CRD = "customresourcedefinition/pdservices.pdserve.io"
SERVING = "serving"
OLD_DESCRIPTION = "(description of an older chart release)"


@pytest.fixture(scope="module")
def own_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, ClusterHelper]]:
    local = LocalCluster(tmp_path_factory.mktemp("lifecycle"), topology="minimal", process_node=True, log=print)
    with local:
        yield local, ClusterHelper.from_cluster(local)


def _helm(local: LocalCluster, *args: str) -> str:
    proc = subprocess.run(local.helm_command(*args), capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, f"helm {' '.join(args)}:\n{proc.stderr}"
    return str(proc.stdout)


def _older_chart(folder: Path) -> Path:
    """The chart as an older release: another version, and a CRD whose schema differs (a field's description)."""
    chart = folder / "pdserve"
    shutil.copytree(CHART, chart)
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    meta["version"] = "0.0.9"
    (chart / "Chart.yaml").write_text(yaml.safe_dump(meta))
    crd = yaml.safe_load((chart / "files" / "crds" / "pdservice.yaml").read_text())
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["model"][
        "description"
    ] = OLD_DESCRIPTION
    (chart / "files" / "crds" / "pdservice.yaml").write_text(yaml.safe_dump(crd))
    return chart


def _model_description(cluster: ClusterHelper) -> str:
    crd = cluster.get_json(CRD)
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return str(schema["properties"]["spec"]["properties"]["model"]["description"])


def _operator_pods(cluster: ClusterHelper) -> set[str]:
    pods = cluster.pods(SYSTEM_NAMESPACE, "app.kubernetes.io/component=operator")
    running = [p for p in pods if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]
    return {p["metadata"]["name"] for p in running}


def _children(cluster: ClusterHelper) -> dict[str, str]:
    """name -> UID of the PDService's StatefulSets and Deployment (the same UIDs mean nothing was recreated)."""
    items = cluster.get_json("statefulsets,deployments", f"--namespace={SERVING}")["items"]
    return {f"{i['kind']}/{i['metadata']['name']}": i["metadata"]["uid"] for i in items}


def _available(cluster: ClusterHelper) -> str:
    pds: dict[str, Any] = cluster.get_json("pdservices.pdserve.io", "demo", f"--namespace={SERVING}")
    conditions = {c["type"]: c["status"] for c in pds.get("status", {}).get("conditions", [])}
    return str(conditions.get("Available", "Unknown"))


def test_install_upgrade_uninstall_and_install_again(
    own_cluster: tuple[LocalCluster, ClusterHelper], tmp_path: Path
) -> None:
    local, cluster = own_cluster
    install = ["install", "pdserve", "--namespace", SYSTEM_NAMESPACE, "--create-namespace", "--wait", "--timeout=3m"]

    # 1. Install (an older chart release): CRD, RBAC and the operator, in-cluster on the process node.
    _helm(local, *install[:2], str(_older_chart(tmp_path)), *install[2:])
    assert _model_description(cluster) == OLD_DESCRIPTION
    assert len(_operator_pods(cluster)) == 2
    cluster.kubectl("create", "namespace", SERVING)
    document = yaml.safe_load((ROOT / "examples" / "local-sim.yaml").read_text())
    document["metadata"]["namespace"] = SERVING
    cluster.apply(document)
    cluster.kubectl("wait", "--for=condition=Available", "pds/demo", f"-n={SERVING}", "--timeout=120s", timeout=140)
    children = _children(cluster)
    before = _operator_pods(cluster)

    # 2. Upgrade to this chart: the CRD's schema follows the chart, the operator pods are replaced, the PDService
    #    and its children are untouched.
    _helm(local, "upgrade", "pdserve", str(CHART), "--namespace", SYSTEM_NAMESPACE, "--wait", "--timeout=3m")
    generated = custom_resource_definition()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert _model_description(cluster) == generated["properties"]["spec"]["properties"]["model"]["description"]
    wait_for(lambda: len(after := _operator_pods(cluster)) == 2 and not after & before, 90, message="new pods")
    assert _children(cluster) == children and _available(cluster) == "True"

    # 3. Uninstall: the operator and its RBAC go; the CRD stays (resource-policy keep), so the PDService and its
    #    running engines stay too.
    _helm(local, "uninstall", "pdserve", "--namespace", SYSTEM_NAMESPACE, "--wait")
    assert cluster.kubectl("get", "deployment", "pdserve", f"-n={SYSTEM_NAMESPACE}", check=False).returncode != 0
    assert cluster.kubectl("get", "clusterrole", "pdserve", check=False).returncode != 0
    kept = cluster.get_json(CRD)["metadata"]
    assert kept["annotations"]["helm.sh/resource-policy"] == "keep"
    assert _children(cluster) == children and _available(cluster) == "True"
    assert len(cluster.pod_ips(SERVING, "pdserve.io/role in (prefill,decode,router)")) == 4

    # 4. Install again under the same release name: Helm adopts the kept CRD (it still carries the release's
    #    ownership annotations) and the new operator manages the PDService that outlived the old one.
    _helm(local, *install[:2], str(CHART), *install[2:])
    cluster.kubectl("patch", "pds/demo", f"-n={SERVING}", "--type=merge", "-p", '{"spec":{"decode":{"replicas":1}}}')
    wait_for(
        lambda: cluster.get_json("statefulset", "demo-decode", f"-n={SERVING}")["spec"]["replicas"] == 1,
        60,
        message="the reinstalled operator to scale decode to 1",
    )
    assert _children(cluster) == children

    # 5. Deleting the CRD (what uninstall leaves to you) deletes every PDService, and garbage collection their
    #    children: the README says so; this is what it means.
    cluster.kubectl("delete", CRD, "--wait=true", timeout=90)
    wait_for(lambda: not _children(cluster), 90, message="the PDService's children to be garbage-collected")
