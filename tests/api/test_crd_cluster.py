"""The generated CRD, unmodified, on a real kube-apiserver: accepted, and its CEL rules reject what they should."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.api.defaults import EffectiveEngine
from pdserve.api.rules import RULES
from pdserve_dev.testing.cluster import ClusterHelper

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def namespace(cluster: ClusterHelper) -> str:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds" / "pdservice.yaml"))
    cluster.wait_crd_established()
    return cluster.create_namespace("crd")


def example(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text())
    return doc


def dry_run(cluster: ClusterHelper, namespace: str, doc: dict[str, Any]) -> tuple[int, str]:
    doc = copy.deepcopy(doc)
    doc["metadata"]["namespace"] = namespace
    result = cluster.kubectl(
        "apply", "--dry-run=server", "--validate=strict", "-f", "-", input=json.dumps(doc), check=False
    )
    return result.returncode, result.stdout + result.stderr


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "examples").glob("*.yaml") if p.stem != "invalid"))
def test_examples_are_admitted(cluster: ClusterHelper, namespace: str, name: str) -> None:
    code, output = dry_run(cluster, namespace, example(name))
    assert code == 0, output


def _set(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    node = doc
    *parents, leaf = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return doc


# The cross-field (CEL) rules are checked case by case, against `pdserve validate`, in test_rule_agreement.py.
REJECTED = [
    ("spec.engine.kvConnector", "lmcache", "Unsupported value"),
    ("spec.engine.blockSize", 48, "Unsupported value"),
    ("spec.slo", {"ttftMilliseconds": 0}, "should be greater than 0"),
    ("spec.decode.autoscaling", {"mode": "keda"}, "Unsupported value"),
    ("metadata.name", "x" * 41, "metadata.name"),
]


@pytest.mark.parametrize(("path", "value", "message"), REJECTED, ids=[r[0] for r in REJECTED])
def test_schema_rules(cluster: ClusterHelper, namespace: str, path: str, value: Any, message: str) -> None:
    code, output = dry_run(cluster, namespace, _set(example("minimal"), path, value))
    assert code != 0, f"{path}={value!r} was admitted"
    assert message in output, output


def test_kubectl_explain_states_the_table_default(cluster: ClusterHelper, namespace: str) -> None:
    """The defaults table writes the "Default ..." sentence users read with `kubectl explain`."""
    output = cluster.kubectl("explain", "pdservices.spec.engine.port").stdout
    assert f"Default {EffectiveEngine.port}." in " ".join(output.split()), output


def test_unknown_field_rejected_by_strict_validation(cluster: ClusterHelper, namespace: str) -> None:
    code, output = dry_run(cluster, namespace, _set(example("minimal"), "spec.decode.replica", 2))
    assert code != 0 and "replica" in output


def test_printer_columns(cluster: ClusterHelper, namespace: str) -> None:
    doc = example("minimal")
    doc["metadata"]["namespace"] = namespace
    cluster.kubectl("apply", "-f", "-", input=json.dumps(doc))
    table = cluster.kubectl("get", "pds", "-n", namespace).stdout
    header = table.splitlines()[0].split()
    assert header == [
        "NAME",
        "MODEL",
        "PREFILL-READY",
        "PREFILL-DESIRED",
        "DECODE-READY",
        "DECODE-DESIRED",
        "AVAILABLE",
        "AGE",
    ]
    assert "qwen2.5-7b" in table


def test_quantity_pattern_agrees_with_kubernetes(cluster: ClusterHelper, namespace: str) -> None:
    """A quantity the CRD admits is one the API server parses (the renderer copies it into StatefulSets), and a
    spelling Kubernetes rejects ("1K", "1ki") is rejected by the CRD instead of failing later as ApplyFailed."""
    good = ["8", "500m", "0.5", ".5", "1k", "16Gi", "1Ei", "1E", "1e3", "1E-3", "+2", "100u", "5n"]
    bad = ["1K", "1ki", "1mi", "1ni", "1ui", "1gi", "1KB", "-1", "1e", ""]
    disagreements = []
    for quantity in good + bad:
        quota = {
            "apiVersion": "v1",
            "kind": "ResourceQuota",
            "metadata": {"name": "q", "namespace": namespace},
            "spec": {"hard": {"memory": quantity}},
        }
        core, _ = dry_run(cluster, namespace, quota)
        crd, _ = dry_run(cluster, namespace, _set(example("minimal"), "spec.engine.shmSize", quantity))
        if (core == 0) != (crd == 0) or (core == 0) != (quantity in good):
            disagreements.append(f"{quantity!r}: ResourceQuota rc={core}, PDService rc={crd}")
    assert disagreements == [], "; ".join(disagreements)


# Env vars and tolerations the CRD admits are copied into pod templates: what a Pod rejects, the CRD must reject.
RULE = {rule.name: rule for rule in RULES}
POD_INVALID = [
    (
        "env",
        [{"name": "A", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
        "env-value-or-value-from",
    ),
    ("tolerations", [{"key": "k", "operator": "Exists", "value": "v"}], "toleration-exists-has-no-value"),
    (
        "tolerations",
        [{"key": "k", "effect": "NoSchedule", "tolerationSeconds": 5}],
        "toleration-seconds-needs-no-execute",
    ),
    ("tolerations", [{"effect": "NoSchedule"}], "toleration-empty-key-needs-exists"),
]


@pytest.mark.parametrize(("field", "value", "rule"), POD_INVALID, ids=[rule for _, _, rule in POD_INVALID])
def test_env_and_tolerations_a_pod_rejects(
    cluster: ClusterHelper, namespace: str, field: str, value: Any, rule: str
) -> None:
    message = RULE[rule].message
    container = {"name": "c", "image": "i", **({"env": value} if field == "env" else {})}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": namespace},
        "spec": {"containers": [container], **({"tolerations": value} if field == "tolerations" else {})},
    }
    code, output = dry_run(cluster, namespace, pod)
    assert code != 0, f"a Pod admits {field}={value}: the rule is stricter than Kubernetes"
    code, output = dry_run(cluster, namespace, _set(example("minimal"), f"spec.decode.{field}", value))
    assert code != 0, f"the CRD admits {field}={value}"
    assert message in output, output


def _fields(schema: dict[str, Any], path: str) -> dict[str, dict[str, Any]]:
    """Every field under `schema` as the dotted path kubectl explain takes (list items and map values are their
    field's own: `spec.env.name`) -> its schema."""
    fields: dict[str, dict[str, Any]] = {}
    for name, node in (schema.get("properties") or {}).items():
        here = f"{path}.{name}"
        fields[here] = node
        inner = node
        while inner.get("type") == "array" and isinstance(inner.get("items"), dict):
            inner = inner["items"]
        fields |= _fields(inner, here)
    return fields


def _explained(text: str, root: str) -> set[str]:
    """The dotted paths `kubectl explain ROOT --recursive` lists: lines `NAME <TYPE>` indented two spaces per level
    (the `enum: ...` lines under a field are not fields)."""
    paths: set[str] = set()
    stack: list[str] = []
    lines = text.splitlines()
    for line in lines[lines.index("FIELDS:") + 1 :]:
        words = line.split()
        if len(words) < 2 or not words[1].startswith("<"):
            continue
        depth = (len(line) - len(line.lstrip(" "))) // 2 - 1
        stack[depth:] = [line.split()[0]]
        paths.add(".".join([root, *stack]))
    return paths


def test_kubectl_explain_documents_every_field(cluster: ClusterHelper, namespace: str) -> None:
    """What `kubectl explain pdservice.spec...` reads is the API server's published OpenAPI v3 document: every
    spec and status field there has a description, and `kubectl explain --recursive` lists every one of them."""
    document = json.loads(cluster.kubectl("get", "--raw", "/openapi/v3/apis/pdserve.io/v1alpha1").stdout)
    schema = document["components"]["schemas"]["io.pdserve.v1alpha1.PDService"]
    for root in ("spec", "status"):
        fields = _fields(schema["properties"][root], root)
        assert len(fields) > (60 if root == "spec" else 10)
        assert [path for path, node in fields.items() if not node.get("description")] == []
        listed = _explained(cluster.kubectl("explain", f"pdservices.{root}", "--recursive").stdout, root)
        assert listed == set(fields)
    deep = cluster.kubectl("explain", "pdservices.spec.placement.tolerations.tolerationSeconds").stdout
    described = _fields(schema["properties"]["spec"], "spec")
    text = described["spec.placement.tolerations.tolerationSeconds"]["description"]
    assert " ".join(text.split())[:60] in " ".join(deep.split()), deep
