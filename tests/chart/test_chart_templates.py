"""The Helm chart, rendered offline (`helm template`, `helm lint --strict`): what each value produces, the guards
that refuse a bad combination, the RBAC list against the operator's code, and the CRD against `pdserve crd`."""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import yaml
from yamllint import linter
from yamllint.config import YamlLintConfig

from pdserve.api.crdgen import crd_yaml
from pdserve.api.defaults import effective
from pdserve_dev.testing.helm import HelmError, lint, template, template_text
from pdserve_operator import kinds
from pdserve_operator.render.router import role as router_role

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "pdserve"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
RBAC_FILE = CHART / "files" / "operator-rbac.yaml"
EXAMPLE = ROOT / "examples" / "minimal.yaml"
NAMESPACED = {"watch": {"mode": "namespaced", "namespaces": ["team-a", "team-b"]}}

Rule = tuple[str, str, str]  # (apiGroup, resource, verb)


def by_kind(objects: Iterable[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: Iterable[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in by_kind(objects, kind) if name is None or o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {[o['metadata']['name'] for o in found]}"
    return found[0]


def container(objects: Iterable[dict[str, Any]]) -> dict[str, Any]:
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    containers: list[dict[str, Any]] = pod["containers"]
    assert [c["name"] for c in containers] == ["operator"]
    return containers[0]


def flatten(rules: Iterable[dict[str, Any]]) -> set[Rule]:
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def rbac_file() -> dict[str, list[dict[str, Any]]]:
    data: dict[str, list[dict[str, Any]]] = yaml.safe_load(RBAC_FILE.read_text())
    return data


# ------------------------------------------------------------------------------------------------- lint, metadata


@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: p.name)
def test_helm_lint_strict_passes_every_ci_values_file(values_file: Path) -> None:
    result = lint(CHART, values_files=[values_file])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout


def test_ci_values_cover_the_documented_setups() -> None:
    assert {p.name for p in CI_VALUES} >= {
        "default-values.yaml",
        "namespaced-values.yaml",
        "cluster-wide-values.yaml",
        "monitoring-values.yaml",
        "ha-values.yaml",
    }


def test_schema_rejects_unknown_keys_wrong_types_and_enums() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"operator": {"replica": 3}}, "replica"),
        ({"watch": {"mode": "everywhere"}}, "/watch/mode"),
        ({"operator": {"replicas": "two"}}, "replicas"),
        ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
        ({"scalers": [{"pdservice": "a", "namespace": "b", "pool": "router"}]}, "pool"),
    ]
    for values, needle in cases:
        result = lint(CHART, values=values)
        assert result.returncode != 0, values
        assert needle in result.stdout + result.stderr, values


def test_app_version_is_the_pdserve_version_and_the_default_image_tag() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"]
    objects = template(CHART)
    assert container(objects)["image"] == f"ghcr.io/pdserve/pdserve:{project['version']}"
    digest = "sha256:" + "ab" * 32
    assert container(template(CHART, values={"image.digest": digest}))["image"] == f"ghcr.io/pdserve/pdserve@{digest}"


def schema_leaves(node: dict[str, Any], path: tuple[str, ...] = ()) -> Iterable[tuple[tuple[str, ...], dict[str, Any]]]:
    """(path, schema) of every value the chart defines: the properties of its own objects (those with
    additionalProperties false), not the inside of Kubernetes types such as resources or affinity."""
    for key, child in node.get("properties", {}).items():
        yield (*path, key), child
        if child.get("type") == "object" and child.get("additionalProperties") is False:
            yield from schema_leaves(child, (*path, key))


def test_every_value_is_documented() -> None:
    """Every value of values.yaml has a comment right above it, and the schema describes it."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["additionalProperties"] is False
    leaves = dict(schema_leaves(schema))
    blocks = {p for p, node in leaves.items() if node.get("additionalProperties") is False}
    assert [".".join(p) for p, node in leaves.items() if p not in blocks and not node.get("description")] == []
    lines = (CHART / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, str]] = []
    seen, undocumented = set(), []
    for index, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "-")) or ":" not in stripped:
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        key = stripped.split(":", 1)[0]
        path = (*[k for _, k in stack], key)
        stack.append((indent, key))
        if path in leaves and path not in blocks:
            seen.add(path)
            if not lines[index - 1].strip().startswith("#"):
                undocumented.append(".".join(path))
    assert undocumented == []
    # And every value the schema knows is in values.yaml with its default (except Helm's `global`).
    missing = {p for p in leaves if p not in blocks and p not in seen and p[0] != "global" and "scalers" not in p}
    assert missing == set()


# ----------------------------------------------------------------------------------------------------- Deployment


def test_default_operator_deployment() -> None:
    objects = template(CHART)
    deploy = one(objects, "Deployment")
    assert deploy["spec"]["replicas"] == 2
    c = container(objects)
    assert c["command"] == ["pdserve", "operator"]
    args = c["args"]
    assert "--all-namespaces" in args and not any(a.startswith("--namespace") for a in args)
    assert "--leader-elect" in args
    assert "--lease-name=pdserve" in args and "--lease-namespace=pdserve-system" in args
    assert not any(a.startswith("--prometheus-url") for a in args)  # only rendered when set
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"metrics": 8080, "health": 8081}
    assert "--metrics-port=8080" in args and "--health-port=8081" in args
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]


def test_secure_pod_defaults() -> None:
    objects = template(CHART)
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    security = container(objects)["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    # The read-only root filesystem leaves /tmp, an emptyDir, as the one writable place.
    assert container(objects)["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    assert "emptyDir" in pod["volumes"][0]


def test_dockerfile_user_matches_the_pod_security_context() -> None:
    user_lines = [line for line in (ROOT / "Dockerfile").read_text().splitlines() if line.startswith("USER ")]
    assert user_lines == ["USER 65532:65532"]
    pod = one(template(CHART), "Deployment")["spec"]["template"]["spec"]
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (65532, 65532)


def test_placement_priority_and_pdb_values() -> None:
    objects = template(CHART, values_files=[CHART / "ci" / "ha-values.yaml"])
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert one(objects, "Deployment")["spec"]["replicas"] == 3
    assert pod["priorityClassName"] == "system-cluster-critical"
    assert pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert pod["topologySpreadConstraints"][0]["topologyKey"] == "topology.kubernetes.io/zone"
    pdb = one(objects, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"] == one(objects, "Deployment")["spec"]["selector"]
    wide = template(CHART, values_files=[CHART / "ci" / "cluster-wide-values.yaml"])
    pod = one(wide, "Deployment")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert pod["tolerations"][0]["key"] == "node-role.kubernetes.io/control-plane"
    # One replica: no PDB (it would block every node drain).
    single = template(CHART, values={"operator.replicas": 1, "operator.leaderElection.enabled": False})
    assert by_kind(single, "PodDisruptionBudget") == []
    assert "--no-leader-elect" in container(single)["args"]


def test_prometheus_url_is_passed_only_when_set() -> None:
    url = "http://prometheus-operated.monitoring.svc:9090"
    args = container(template(CHART, values={"operator.prometheusUrl": url}))["args"]
    assert f"--prometheus-url={url}" in args


def test_model_host_paths_are_passed_one_flag_each() -> None:
    assert not [a for a in container(template(CHART))["args"] if a.startswith("--allow-model-host-paths")]
    args = container(template(CHART, values={"operator.allowModelHostPaths": ["/mnt/models", "/data/llm"]}))["args"]
    allowed = [a for a in args if a.startswith("--allow-model-host-paths")]
    assert allowed == ["--allow-model-host-paths=/mnt/models", "--allow-model-host-paths=/data/llm"]
    with pytest.raises(HelmError):
        template(CHART, values={"operator.allowModelHostPaths": ["models"]})


def test_selectors_never_carry_the_chart_version_nor_match_pdservice_pods() -> None:
    objects = template(CHART, values_files=[CHART / "ci" / "monitoring-values.yaml"])
    selectors = [
        one(objects, "Deployment")["spec"]["selector"]["matchLabels"],
        one(objects, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"],
        one(objects, "Service")["spec"]["selector"],
        one(objects, "ServiceMonitor")["spec"]["selector"]["matchLabels"],
    ]
    for selector in selectors:
        assert "helm.sh/chart" not in selector and "app.kubernetes.io/version" not in selector
        # PDService children carry name=pdserve with component router/prefill/decode, never operator.
        assert selector["app.kubernetes.io/component"] == "operator"
    # The operator treats objects labelled managed-by=pdserve-operator as its children: the chart's are Helm's.
    assert all(o["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm" for o in objects)


def test_namespaced_mode_passes_each_namespace() -> None:
    args = container(template(CHART, values=NAMESPACED))["args"]
    assert [a for a in args if a.startswith("--namespace")] == ["--namespace=team-a", "--namespace=team-b"]
    assert "--all-namespaces" not in args


# ----------------------------------------------------------------------------------------------------------- RBAC


def operator_needs() -> tuple[set[Rule], set[Rule]]:
    """(namespaced, release-namespace) access derived from the operator's code: what it applies, prunes, watches,
    reads, posts, and what it must hold to grant the router's Role."""
    crud = ("get", "list", "watch", "create", "patch", "delete")  # SSA PATCH that creates is authorized as create
    read = ("get", "list", "watch")
    need: set[Rule] = set()
    for kind in kinds.MANAGED:
        need |= {(kind.group, kind.plural, verb) for verb in crud}
    for kind in (kinds.POD, kinds.ENDPOINT_SLICE):
        need |= {(kind.group, kind.plural, verb) for verb in read}
    need |= {(kinds.PDSERVICE.group, kinds.PDSERVICE.plural, verb) for verb in read}
    need.add((kinds.PDSERVICE.group, f"{kinds.PDSERVICE.plural}/status", "patch"))
    need.add((kinds.EVENT.group, kinds.EVENT.plural, "create"))
    # The SLO autoscaler's actuator: KubeApi.scale, a PATCH of the pool StatefulSet's /scale.
    need.add((kinds.STATEFUL_SET.group, f"{kinds.STATEFUL_SET.plural}/scale", "patch"))
    # Router mode gateway: the InferencePool, applied (create/patch) and read back by name (KubeApi.read).
    need |= {(kinds.INFERENCE_POOL.group, kinds.INFERENCE_POOL.plural, verb) for verb in ("get", "create", "patch")}
    lease = {(kinds.LEASE.group, kinds.LEASE.plural, verb) for verb in ("get", "create", "update")}
    return need, lease


def test_rbac_list_is_exactly_what_the_operator_code_uses() -> None:
    rules = rbac_file()
    need, lease = operator_needs()
    assert flatten(rules["watched"]) == need
    assert flatten(rules["leaderElection"]) == lease
    # Kubernetes lets the operator create the router's Role only if it holds every permission in it.
    from pdserve.api.v1alpha1 import PDService

    pds = PDService.model_validate(yaml.safe_load(EXAMPLE.read_text()))
    assert flatten(router_role(pds, effective(pds.spec))["rules"]) <= flatten(rules["watched"])
    # Cluster-scoped: kopf's CRD watch, the nodes engine pods run on (read by name: `nodes.py`), and in namespaced
    # mode its namespace watch.
    assert flatten(rules["cluster"]) == {
        ("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("list", "watch")
    } | {(kinds.NODE.group, kinds.NODE.plural, "get")}
    assert flatten(rules["namespacedModeCluster"]) == {("", "namespaces", v) for v in ("list", "watch")}


def test_cluster_mode_rbac() -> None:
    rules = rbac_file()
    objects = template(CHART)
    role = one(objects, "ClusterRole", "pdserve")
    assert flatten(role["rules"]) == flatten(rules["watched"]) | flatten(rules["cluster"])
    binding = one(objects, "ClusterRoleBinding", "pdserve")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "pdserve", "namespace": "pdserve-system"}]
    assert binding["roleRef"]["name"] == "pdserve"
    lease_role = one(objects, "Role", "pdserve-leader-election")
    assert lease_role["metadata"]["namespace"] == "pdserve-system"
    assert flatten(lease_role["rules"]) == flatten(rules["leaderElection"])
    assert [r["metadata"]["name"] for r in by_kind(objects, "Role")] == ["pdserve-leader-election"]


def test_namespaced_mode_rbac_grants_only_in_the_listed_namespaces() -> None:
    rules = rbac_file()
    objects = template(CHART, values={**NAMESPACED, "rbac.aggregateToDefaultRoles": False})
    roles = {(r["metadata"]["namespace"], r["metadata"]["name"]): r for r in by_kind(objects, "Role")}
    assert set(roles) == {
        ("team-a", "pdserve"),
        ("team-b", "pdserve"),
        ("pdserve-system", "pdserve-leader-election"),
    }
    for namespace in ("team-a", "team-b"):
        assert flatten(roles[(namespace, "pdserve")]["rules"]) == flatten(rules["watched"])
        bindings = [b for b in by_kind(objects, "RoleBinding") if b["metadata"]["namespace"] == namespace]
        binding = one(bindings, "RoleBinding")
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pdserve"}
    # The only ClusterRole holds cluster-scoped reads, nothing namespaced.
    cluster_role = one(objects, "ClusterRole")
    assert flatten(cluster_role["rules"]) == flatten(rules["cluster"]) | flatten(rules["namespacedModeCluster"])


def test_chart_readme_lists_the_rbac_rules() -> None:
    readme = (CHART / "README.md").read_text()
    for section in ("watched", "leaderElection", "cluster", "namespacedModeCluster"):
        for rule in rbac_file()[section]:
            groups = ", ".join(g or "core" for g in rule["apiGroups"])
            row = f"| {section} | {groups} | {', '.join(rule['resources'])} | {', '.join(rule['verbs'])} |"
            assert row in readme, row


# ------------------------------------------------------------------------------------------------------------ CRD


def test_chart_crd_copy_is_the_generated_crd() -> None:
    copy = CHART / "files" / "crds" / "pdservice.yaml"
    assert copy.read_text() == crd_yaml(), f"{copy} is stale: run `pdserve crd > {copy.relative_to(ROOT)}`"


def test_rendered_crd_is_the_generated_one_with_labels_and_keep_policy() -> None:
    crd = one(template(CHART), "CustomResourceDefinition")
    generated = yaml.safe_load(crd_yaml())
    assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert generated["metadata"]["labels"].items() <= crd["metadata"]["labels"].items()
    assert crd["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    for key in ("labels", "annotations"):
        crd["metadata"].pop(key)
        generated["metadata"].pop(key, None)
    assert crd == generated
    assert (
        "annotations" not in one(template(CHART, values={"crds.keep": False}), "CustomResourceDefinition")["metadata"]
    )
    assert by_kind(template(CHART, values={"crds.install": False}), "CustomResourceDefinition") == []


# ----------------------------------------------------------------------------------------------------- monitoring


MONITORING_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}


def test_monitoring_is_off_by_default_and_complete_when_on() -> None:
    default = template(CHART)
    assert not {o["kind"] for o in default} & MONITORING_KINDS
    assert by_kind(default, "ConfigMap") == []
    objects = template(CHART, values_files=[CHART / "ci" / "monitoring-values.yaml"])
    assert {o["kind"] for o in objects} >= MONITORING_KINDS | {"ConfigMap"}
    monitor = one(objects, "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    pods = one(objects, "PodMonitor")
    assert pods["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/managed-by": "pdserve-operator"}
    assert pods["spec"]["namespaceSelector"] == {"any": True}
    assert [endpoint["port"] for endpoint in pods["spec"]["podMetricsEndpoints"]] == ["http", "metrics"]
    rule = one(objects, "PrometheusRule")
    rules = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    assert rules and all(r["expr"] for r in rules)
    assert all(r["labels"]["team"] == "serving" for r in rules if "alert" in r)
    dashboard = one(objects, "ConfigMap")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["pdserve.json"])["panels"]


def test_pod_monitor_follows_namespaced_mode() -> None:
    objects = template(CHART, values={**NAMESPACED, "monitoring.podMonitor.enabled": True})
    assert one(objects, "PodMonitor")["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}


# ------------------------------------------------------------------------------------------------ scalers / guards


def hpa(pool: str = "decode", **extra: Any) -> dict[str, Any]:
    return {
        "pdservice": "llama-8b",
        "namespace": "team-a",
        "pool": pool,
        "kind": "HorizontalPodAutoscaler",
        "minReplicas": 1,
        "maxReplicas": 4,
        **extra,
    }


def test_scaler_targets_the_pool_statefulset() -> None:
    keda = {**hpa("prefill"), "kind": "ScaledObject", "triggers": [{"type": "cpu", "metadata": {"value": "80"}}]}
    objects = template(CHART, values={"scalers": [hpa(), keda]})
    autoscaler = one(objects, "HorizontalPodAutoscaler")
    assert autoscaler["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": "llama-8b-decode",
    }
    assert (autoscaler["spec"]["minReplicas"], autoscaler["spec"]["maxReplicas"]) == (1, 4)
    scaled = one(objects, "ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["scaleTargetRef"]["name"] == "llama-8b-prefill"
    assert scaled["metadata"]["namespace"] == "team-a"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"scalers": [hpa(), {**hpa(), "kind": "ScaledObject"}]}, "pool team-a/llama-8b/decode would have two owners"),
        ({**NAMESPACED, "scalers": [{**hpa(), "namespace": "elsewhere"}]}, "which this operator does not watch"),
        ({"scalers": [hpa(minReplicas=5)]}, "minReplicas 5 is greater than maxReplicas 4"),
        ({"watch": {"mode": "namespaced", "namespaces": []}}, "needs at least one namespace"),
        ({"operator.leaderElection.enabled": False}, "needs operator.leaderElection.enabled"),
        ({"operator.leaderElection.renewDeadlineSeconds": 20}, "renewDeadlineSeconds must be shorter"),
        ({"monitoring.serviceMonitor.enabled": True, "metrics.service.enabled": False}, "needs metrics.service"),
    ],
)
def test_render_fails_on_a_bad_combination(values: dict[str, Any], message: str) -> None:
    with pytest.raises(HelmError) as error:
        template(CHART, values=values)
    assert message in str(error.value)


def test_two_scalers_on_different_pools_are_fine() -> None:
    objects = template(CHART, values={"scalers": [hpa("decode"), hpa("prefill")]})
    assert len(by_kind(objects, "HorizontalPodAutoscaler")) == 2


def test_scalers_and_pdserves_autoscaler_live_side_by_side() -> None:
    """Per-pool ownership (`autoscaling.mode`): an HPA on one pool and pdserve's autoscaler on others render
    together (the PDService hands the HPA's pool over with mode external)."""
    values = {"scalers": [hpa("decode")], "operator.prometheusUrl": "http://prometheus:9090"}
    objects = template(CHART, values=values)
    assert one(objects, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]["name"] == "llama-8b-decode"
    assert "--prometheus-url=http://prometheus:9090" in container(objects)["args"]
    assert lint(CHART, values=values).returncode == 0


# --------------------------------------------------------------------------------------------------------- yamllint


@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: p.name)
def test_rendered_manifests_pass_yamllint(values_file: Path) -> None:
    """The templates themselves are not YAML ({{ }}), so yamllint checks what they render (the repository's
    .yamllint.yaml; `scripts/test.sh` lints the chart's plain YAML files and examples/ directly). Line length
    is not checked here: `toYaml` and the embedded CRD decide it, not a person."""
    config = YamlLintConfig(f"extends: {ROOT / '.yamllint.yaml'}\nrules:\n  line-length: disable\n")
    text = template_text(CHART, values_files=[values_file])
    problems = [f"{p.line}:{p.column} {p.rule} {p.message}" for p in linter.run(text, config)]
    assert problems == []
