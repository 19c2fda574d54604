"""The chart against the local cluster's real API server: every ci values file passes a server-side dry run (the
monitoring objects against the Prometheus Operator's own CRDs), the chart and an example apply twice without a
diff, `kubectl auth can-i --list` for the chart's ServiceAccount is the documented list, and the operator running
under that ServiceAccount's token brings a PDService to Ready.

The chart's own operator pods are kept off every node (a nodeSelector no node has): the operator under test runs as
a subprocess with the ServiceAccount's token, namespaced to its test namespace, so it never acts on other tests'
PDServices. Cluster-scoped objects get a per-test name (fullnameOverride) and are deleted afterwards.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.api.crdgen import custom_resource_definition
from pdserve_dev.cluster import tools
from pdserve_dev.testing.cluster import ClusterHelper
from pdserve_dev.testing.helm import template_text
from pdserve_dev.testing.operator import OperatorProcess, ensure_cpu_node
from pdserve_dev.testing.wait import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "pdserve"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
RBAC = yaml.safe_load((CHART / "files" / "operator-rbac.yaml").read_text())
NEVER_SCHEDULED = {"operator.nodeSelector": {"pdserve.io/chart-test": "never-scheduled"}}
KWOK_PRODUCT = "NVIDIA-H100-80GB-HBM3"

Grant = tuple[str, str]  # ("resource.group", verb) as `kubectl auth can-i --list` names them


def _apply_crd(cluster: ClusterHelper, text: str, name: str) -> None:
    wait_for(lambda: cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=text), 60)
    cluster.wait_crd_established(name)


@pytest.fixture(scope="module")
def crds(cluster: ClusterHelper) -> None:
    """The PDService CRD, and ServiceMonitor, PodMonitor and PrometheusRule from the Prometheus Operator's module."""
    _apply_crd(cluster, yaml.safe_dump(custom_resource_definition()), "pdservices.pdserve.io")
    for path in tools.prometheus_operator_crds():
        name = yaml.safe_load(path.read_text())["metadata"]["name"]
        _apply_crd(cluster, path.read_text(), name)
    wait_for(lambda: cluster.kubectl("get", "pdservices.pdserve.io,servicemonitors,podmonitors,prometheusrules", "-A"))
    ensure_cpu_node(cluster)


@pytest.fixture
def namespace(cluster: ClusterHelper, crds: None) -> Iterator[str]:
    name = cluster.create_namespace("chart")
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def install(cluster: ClusterHelper, namespace: str, values: dict[str, Any]) -> list[dict[str, Any]]:
    """Apply the chart's objects (server-side) with a release named after the namespace; return them."""
    values = {"fullnameOverride": f"pdserve-{namespace}", "crds.install": False, **NEVER_SCHEDULED, **values}
    text = template_text(CHART, values=values, namespace=namespace, release=f"pdserve-{namespace}")
    cluster.apply(text)
    return [doc for doc in yaml.safe_load_all(text) if doc]


@pytest.fixture
def cleanup_cluster_scoped(cluster: ClusterHelper) -> Iterator[list[str]]:
    """Names of ClusterRoles/ClusterRoleBindings a test created, deleted at the end."""
    names: list[str] = []
    yield names
    for name in names:
        cluster.kubectl(
            "delete", "clusterrole,clusterrolebinding", "-l", f"app.kubernetes.io/instance={name}", check=False
        )


# -------------------------------------------------------------------------------------------- server-side dry run


@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: p.name)
def test_every_ci_values_file_passes_a_server_side_dry_run(
    cluster: ClusterHelper, namespace: str, values_file: Path
) -> None:
    for watched in yaml.safe_load(values_file.read_text()).get("watch", {}).get("namespaces", []):
        cluster.kubectl("create", "namespace", watched, check=False)  # the chart creates Roles in them
    text = template_text(CHART, values_files=[values_file], namespace=namespace)
    objects = [doc for doc in yaml.safe_load_all(text) if doc]
    result = cluster.kubectl(
        "apply", "--dry-run=server", "--server-side", "--field-manager=helm", "-f", "-", input=text
    )
    accepted = [line for line in result.stdout.splitlines() if line.endswith("(server dry run)")]
    assert len(accepted) == len(objects), result.stdout


# -------------------------------------------------------------------------------------------- server-side apply


def _no_diff(cluster: ClusterHelper, text: str, namespace: str) -> None:
    result = cluster.kubectl(
        "diff",
        "--server-side",
        "--field-manager=pdserve-tests",
        f"--namespace={namespace}",
        "-f",
        "-",
        input=text,
        check=False,
    )
    assert (result.returncode, result.stdout) == (0, ""), result.stdout + result.stderr


def test_chart_and_example_apply_twice_without_a_diff(
    cluster: ClusterHelper, namespace: str, cleanup_cluster_scoped: list[str]
) -> None:
    """What Argo CD's ServerSideApply sync and Flux see: after one apply, the same manifests differ in nothing."""
    release = f"pdserve-{namespace}"
    cleanup_cluster_scoped.append(release)
    values = {"fullnameOverride": release, **NEVER_SCHEDULED}
    values_file = CHART / "ci" / "monitoring-values.yaml"
    text = template_text(CHART, values_files=[values_file], values=values, namespace=namespace, release=release)
    cluster.apply(text)
    # Let the controllers write their first status (a Deployment's, a PDB's) so the diff compares settled objects.
    wait_for(
        lambda: (
            cluster.get_json("deployment", release, f"--namespace={namespace}")["status"].get("observedGeneration") == 1
        ),
        30,
    )
    _no_diff(cluster, text, namespace)
    cluster.apply(text)
    _no_diff(cluster, text, namespace)
    for example in ("local-sim.yaml", "minimal.yaml", "pdservice.yaml"):
        document = yaml.safe_load((ROOT / "examples" / example).read_text())
        document["metadata"]["namespace"] = namespace  # examples/pdservice.yaml names `default`
        manifest = yaml.safe_dump(document)
        cluster.apply(manifest)
        _no_diff(cluster, manifest, namespace)


# --------------------------------------------------------------------------------------------------------- RBAC


def can_i_list(cluster: ClusterHelper, namespace: str, user: str) -> set[Grant]:
    """Rules without resource names (the operator's are all of that kind)."""
    return {(resource, verb) for resource, name, verb in cluster.can_i_list(namespace, user) if not name}


def documented(*sections: str) -> set[Grant]:
    grants: set[Grant] = set()
    for section in sections:
        for rule in RBAC[section]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    base, _, sub = resource.partition("/")  # kubectl names pdservices/status pdservices.g/status
                    name = (f"{base}.{group}" if group else base) + (f"/{sub}" if sub else "")
                    grants |= {(name, verb) for verb in rule["verbs"]}
    return grants


def granted(cluster: ClusterHelper, namespace: str, service_account: str) -> set[Grant]:
    """What the chart's ServiceAccount may do in `namespace`, minus what every ServiceAccount may (discovery,
    self reviews): the namespace's `default` ServiceAccount is the baseline."""
    baseline = can_i_list(cluster, namespace, f"system:serviceaccount:{namespace}:default")
    return can_i_list(cluster, namespace, f"system:serviceaccount:{namespace}:{service_account}") - baseline


def test_can_i_list_is_the_documented_list_in_namespaced_mode(
    cluster: ClusterHelper, namespace: str, cleanup_cluster_scoped: list[str]
) -> None:
    release = f"pdserve-{namespace}"
    cleanup_cluster_scoped.append(release)
    objects = install(cluster, namespace, {"watch": {"mode": "namespaced", "namespaces": [namespace]}})
    expected = documented("watched", "leaderElection", "cluster", "namespacedModeCluster")
    assert granted(cluster, namespace, release) == expected
    # Nothing at all in a namespace it does not watch, beyond the cluster-scoped reads.
    other = cluster.create_namespace("chart-other")
    try:
        user = f"system:serviceaccount:{namespace}:{release}"
        others = can_i_list(cluster, other, user) - can_i_list(cluster, other, f"system:serviceaccount:{other}:default")
        assert others == documented("cluster", "namespacedModeCluster")
    finally:
        cluster.kubectl("delete", "namespace", other, "--wait=false", check=False)
    # Nor in kube-system (docs/security.md): compared with a ServiceAccount of the same namespace that holds nothing.
    user = f"system:serviceaccount:{namespace}:{release}"
    baseline = can_i_list(cluster, "kube-system", f"system:serviceaccount:{namespace}:default")
    assert can_i_list(cluster, "kube-system", user) - baseline == documented("cluster", "namespacedModeCluster")
    # And no ClusterRole bound to it names a namespaced resource, by the API server's own list of them.
    namespaced = set(cluster.kubectl("api-resources", "--namespaced=true", "-o", "name").stdout.split())
    cluster_roles = {o["roleRef"]["name"] for o in objects if o["kind"] == "ClusterRoleBinding"}
    cluster_grants = {
        f"{resource}.{group}" if group else resource
        for role in objects
        if role["kind"] == "ClusterRole" and role["metadata"]["name"] in cluster_roles
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    assert cluster_grants and not cluster_grants & namespaced, cluster_grants & namespaced


def test_can_i_list_is_the_documented_list_in_cluster_mode(
    cluster: ClusterHelper, namespace: str, cleanup_cluster_scoped: list[str]
) -> None:
    release = f"pdserve-{namespace}"
    cleanup_cluster_scoped.append(release)
    install(cluster, namespace, {"rbac.aggregateToDefaultRoles": False})
    assert granted(cluster, namespace, release) == documented("watched", "leaderElection", "cluster")
    other = cluster.create_namespace("chart-other")
    try:
        user = f"system:serviceaccount:{namespace}:{release}"
        others = can_i_list(cluster, other, user) - can_i_list(cluster, other, f"system:serviceaccount:{other}:default")
        assert others == documented("watched", "cluster")  # the Lease only in the release namespace
    finally:
        cluster.kubectl("delete", "namespace", other, "--wait=false", check=False)
    # kube-system included: why docs/security.md recommends namespaced mode where tenants share a cluster.
    baseline = can_i_list(cluster, "kube-system", f"system:serviceaccount:{namespace}:default")
    in_kube_system = can_i_list(cluster, "kube-system", user) - baseline
    assert {("deployments.apps", "create"), ("rolebindings.rbac.authorization.k8s.io", "create")} <= in_kube_system


def _example(namespace: str) -> dict[str, Any]:
    """examples/pdservice.yaml on the kwok topology (H100 nodes, no Secret for a gated model)."""
    document: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "pdservice.yaml").read_text())
    document["metadata"] = {"name": "llama", "namespace": namespace}
    document["spec"]["placement"]["gpuNodeSelector"] = {"nvidia.com/gpu.product": KWOK_PRODUCT}
    del document["spec"]["model"]["hfTokenSecret"]
    return document


def test_operator_reaches_ready_under_the_chart_rbac(
    cluster: ClusterHelper, namespace: str, cleanup_cluster_scoped: list[str], tmp_path: Path
) -> None:
    """The operator, authenticated as the chart's ServiceAccount (a TokenRequest token, as its pod would be), with
    the chart's namespaced RBAC: it leads, applies every child (server-side apply, the router's Role included),
    and the PDService becomes Available and Ready; nothing it did was forbidden."""
    release = f"pdserve-{namespace}"
    cleanup_cluster_scoped.append(release)
    objects = install(cluster, namespace, {"watch": {"mode": "namespaced", "namespaces": [namespace]}})
    args = next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--namespace={namespace}" in args and f"--lease-name={release}" in args
    kubeconfig = cluster.service_account_kubeconfig(namespace, release, tmp_path / "operator.kubeconfig")
    with OperatorProcess(
        kubeconfig,
        tmp_path / "operator.log",
        namespaces=[namespace],
        identity="chart-rbac",
        lease_name=release,
        lease_namespace=namespace,
        extra=["--resync-seconds", "5"],
    ) as operator:
        operator.wait_ready(timeout=90)
        cluster.apply(_example(namespace))
        ready = cluster.kubectl(
            "wait",
            "--for=condition=Ready",
            "pdservices.pdserve.io/llama",
            f"--namespace={namespace}",
            "--timeout=150s",
            timeout=170,
            check=False,
        )
        status = cluster.get_json("pdservices.pdserve.io", "llama", f"--namespace={namespace}").get("status", {})
        assert ready.returncode == 0, f"{status.get('conditions')}\n{operator.log_tail(40)}"
        log = operator.log_tail(400)
    # "HTTP 403" is how the operator's API errors read; a bare "403" is also a timestamp's milliseconds (CI: 17,403).
    denied = [line for line in log.splitlines() if re.search(r"Forbidden|HTTP 403|Not enough permissions", line)]
    assert not denied, log
    roles = cluster.get_json("roles", f"--namespace={namespace}", "-l", "app.kubernetes.io/instance=llama")
    assert [r["metadata"]["name"] for r in roles["items"]] == ["llama-router"]
