"""The chart installed with Helm into the local cluster: the operator runs as a pod on the process node with
in-cluster configuration from the chart's ServiceAccount, and brings an example to Available under the chart's
RBAC, in namespaced and in cluster-wide mode.

What a user would check on a real cluster, checked here: the pods run as the image's non-root user with a
read-only root file system (the process node applies the securityContext), their client configuration is the
in-cluster one (no kubeconfig anywhere in their environment), nothing they did was forbidden, and they wrote
nothing but their /tmp volume (the router has none and still serves).

The session cluster already has the PDService CRD (other tests apply it), so releases here leave it alone
(`crds.install=false`); test_chart_lifecycle.py installs the chart with its CRD on a cluster of its own. Releases
get per-test names (cluster-scoped RBAC objects are named after the release) and are uninstalled afterwards.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.api.crdgen import custom_resource_definition
from pdserve_dev.cluster.cluster import pinned_namespace
from pdserve_dev.testing.cluster import ClusterHelper, ContainerProcess
from pdserve_dev.testing.helm import helm
from pdserve_dev.testing.wait import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "pdserve"
FORBIDDEN = ("Forbidden", '"403"', " 403 ", "Not enough permissions")


@pytest.fixture(scope="module")
def crd(cluster: ClusterHelper) -> None:
    if cluster.process_node_workdir is None:
        pytest.skip("the cluster has no process node")
    text = yaml.safe_dump(custom_resource_definition())
    wait_for(lambda: cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=text), 60)
    cluster.wait_crd_established()


class Release:
    """One Helm release of the chart in a namespace pinned to the process node (like pdserve-system)."""

    def __init__(self, cluster: ClusterHelper, values: dict[str, Any]) -> None:
        suffix = uuid.uuid4().hex[:6]
        self.cluster, self.name, self.namespace = cluster, f"pdserve-{suffix}", f"pdserve-system-{suffix}"
        self.values = {"fullnameOverride": self.name, "crds.install": False, "operator.replicas": 1, **values}

    def install(self) -> None:
        self.cluster.apply(pinned_namespace(self.namespace))
        args = ["install", self.name, str(CHART), f"--namespace={self.namespace}", "--wait", "--timeout=120s"]
        for key, value in self.values.items():
            args.append(f"--set-json={key}={json.dumps(value)}")
        helm(*args, kubeconfig=self.cluster.kubeconfig, timeout=180)

    def uninstall(self) -> None:
        helm(
            "uninstall", self.name, f"--namespace={self.namespace}", "--wait", "--timeout=60s",
            kubeconfig=self.cluster.kubeconfig, check=False, timeout=90,
        )  # fmt: skip
        self.cluster.kubectl("delete", "namespace", self.namespace, "--wait=false", check=False)

    def operator_pod(self) -> dict[str, Any]:
        (pod,) = self.cluster.pods(self.namespace, "app.kubernetes.io/component=operator")
        return pod

    def operator_log(self) -> str:
        return self.cluster.logs(self.namespace, self.operator_pod()["metadata"]["name"], "operator")


@pytest.fixture
def release_factory(cluster: ClusterHelper, crd: None) -> Iterator[list[Release]]:
    releases: list[Release] = []
    yield releases
    for release in releases:
        release.uninstall()


@pytest.fixture
def serving(cluster: ClusterHelper) -> Iterator[str]:
    name = cluster.create_namespace("serving")
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def _example(name: str, namespace: str) -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text())
    document["metadata"]["namespace"] = namespace
    return document


def _wait_available(cluster: ClusterHelper, namespace: str, name: str, log: Any) -> None:
    result = cluster.kubectl(
        "wait", "--for=condition=Available", f"pdservices.pdserve.io/{name}", f"--namespace={namespace}",
        "--timeout=120s", timeout=140, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        status = cluster.get_json("pdservices.pdserve.io", name, f"--namespace={namespace}").get("status", {})
        pytest.fail(f"{name} not Available: {status.get('conditions')}\noperator log:\n{log()[-4000:]}")


def _assert_in_cluster(process: ContainerProcess, cluster: ClusterHelper) -> None:
    """A chart/renderer pod as the kubelet would run it: non-root, the kubernetes Service's variables, no kubeconfig."""
    assert process.uid == 65532, process
    assert "KUBECONFIG" not in process.environ
    assert process.environ["KUBERNETES_SERVICE_HOST"] and process.environ["HOME"] == "/"
    if cluster.local is not None and cluster.local.network.local_route:
        service = cluster.get_json("service", "kubernetes", "--namespace=default")["spec"]
        assert process.environ["KUBERNETES_SERVICE_HOST"] == service["clusterIP"]


def _lines_about(log: str, namespace: str) -> list[str]:
    return [line for line in log.splitlines() if namespace in line]


def test_namespaced_release_runs_in_cluster_and_brings_local_sim_to_available(
    cluster: ClusterHelper, release_factory: list[Release], serving: str
) -> None:
    """Namespaced mode: Roles only in the watched namespace; the operator pod, the router pod and the engines all
    run on the process node, the router discovering engines under its own Role with in-cluster configuration."""
    release = Release(cluster, {"watch.mode": "namespaced", "watch.namespaces": [serving]})
    release_factory.append(release)
    release.install()
    pod = release.operator_pod()
    assert pod["spec"]["nodeName"] == "process-node"
    assert pod["spec"]["serviceAccountName"] == release.name
    operator = cluster.container_process(release.namespace, pod["metadata"]["name"], "operator")
    _assert_in_cluster(operator, cluster)
    cluster.apply(_example("local-sim", serving))
    _wait_available(cluster, serving, "demo", release.operator_log)
    (router,) = cluster.pods(serving, "pdserve.io/role=router")
    assert router["spec"]["nodeName"] == "process-node"
    _assert_in_cluster(cluster.container_process(serving, router["metadata"]["name"], "router"), cluster)
    router_log = cluster.logs(serving, router["metadata"]["name"], "router")
    assert "Updated decode endpoints count=2" in router_log, router_log
    for log in (release.operator_log(), router_log):
        assert not [line for line in log.splitlines() if any(word in line for word in FORBIDDEN)], log[-3000:]
        assert "Read-only file system" not in log
    # The operator's only writable place is its /tmp emptyDir, and it left nothing there. (When the process node's
    # interpreter, checkout or working folder lives under the host's /tmp, the node binds it back below the volume:
    # an empty folder named like that entry of the host's /tmp is the node's mount point.)
    assert cluster.process_node_workdir is not None
    pod_folder = f"{release.namespace}_{pod['metadata']['name']}_*"
    (tmp,) = (cluster.process_node_workdir / "pods").glob(f"{pod_folder}/volumes/tmp")
    left = [
        p.name for p in tmp.iterdir() if not (p.is_dir() and not any(p.iterdir()) and (Path("/tmp") / p.name).is_dir())
    ]
    assert sorted(left) == []


def test_cluster_wide_release_brings_a_kwok_example_to_available(
    cluster: ClusterHelper, release_factory: list[Release], serving: str
) -> None:
    """Cluster mode: a ClusterRole; the operator pod (on the process node) reconciles examples/minimal.yaml in
    another namespace, whose engines and routers are kwok pods on the GPU and CPU nodes."""
    release = Release(cluster, {"watch.mode": "cluster", "rbac.aggregateToDefaultRoles": False})
    release_factory.append(release)
    release.install()
    pod = release.operator_pod()
    assert pod["spec"]["nodeName"] == "process-node"
    _assert_in_cluster(cluster.container_process(release.namespace, pod["metadata"]["name"], "operator"), cluster)
    cluster.apply(_example("minimal", serving))
    _wait_available(cluster, serving, "qwen", release.operator_log)
    engines = cluster.pods(serving, "pdserve.io/role in (prefill,decode)")
    assert engines and all(p["spec"]["nodeName"].startswith("gpu-") for p in engines)
    routers = cluster.pods(serving, "pdserve.io/role=router")
    # On a CPU node: the topology's, or one another test of the session added.
    assert routers and all(not p["spec"]["nodeName"].startswith(("gpu-", "process-node")) for p in routers)
    # Other tests' PDServices may be left in namespaces being deleted: only our namespace's lines count.
    about = _lines_about(release.operator_log(), serving)
    assert about and not [line for line in about if any(word in line for word in FORBIDDEN)], "\n".join(about)
