"""The checked-in CRD is exactly the generated one, and it has what Kubernetes and users need."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from pdserve.api.crdgen import crd_yaml, custom_resource_definition

CRD_FILE = Path(__file__).resolve().parents[2] / "crds" / "pdservice.yaml"


def test_checked_in_crd_is_generated() -> None:
    if os.environ.get("PDSERVE_UPDATE_GOLDEN") == "1":
        CRD_FILE.write_text(crd_yaml())
    assert CRD_FILE.read_text() == crd_yaml(), "crds/pdservice.yaml is stale: run `pdserve crd > crds/pdservice.yaml`"


def _walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = []
    if isinstance(node, dict):
        out.append((path, node))
        for key, value in node.get("properties", {}).items():
            out += _walk(value, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            out += _walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            out += _walk(node["additionalProperties"], f"{path}{{}}")
    return out


def _schema() -> dict[str, Any]:
    version = custom_resource_definition()["spec"]["versions"][0]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def test_every_field_has_a_description() -> None:
    schema = _schema()
    missing = [path for path, node in _walk(schema["properties"]["spec"], "spec") if not node.get("description")]
    missing += [path for path, node in _walk(schema["properties"]["status"], "status") if not node.get("description")]
    # Map values and list items are described by their parent field.
    missing = [p for p in missing if not p.endswith(("{}", "[]"))]
    assert missing == []


def test_schema_is_structural() -> None:
    text = yaml.safe_dump(_schema())
    for forbidden in ("$ref", "anyOf", "title:", "default:", "const:", "$defs"):
        assert forbidden not in text
    for path, node in _walk(_schema()):
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), path
        assert not ("properties" in node and "additionalProperties" in node), path


def test_cel_rules_present() -> None:
    rules = [rule["rule"] for _, node in _walk(_schema()) for rule in node.get("x-kubernetes-validations", [])]
    assert any("minReplicas" in r and "maxReplicas" in r for r in rules)
    assert any("tensorParallelSize" in r for r in rules)
    assert any("topologyKey" in r for r in rules)


def test_api_surface() -> None:
    crd = custom_resource_definition()
    spec = crd["spec"]
    assert crd["metadata"]["name"] == "pdservices.pdserve.io"
    assert spec["group"] == "pdserve.io"
    assert spec["names"]["kind"] == "PDService"
    assert spec["names"]["plural"] == "pdservices"
    assert spec["names"]["shortNames"] == ["pds"]
    version = spec["versions"][0]
    assert version["name"] == "v1alpha1"
    assert version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"] if not c.get("priority")]
    assert columns == [
        "Model",
        "Prefill-Ready",
        "Prefill-Desired",
        "Decode-Ready",
        "Decode-Desired",
        "Available",
        "Age",
    ]
    # `kubectl get pds -o wide`: current pods, the scalers' reasons, the latencies the autoscaler saw, the
    # disaggregation threshold it chose.
    wide = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"] if c.get("priority") == 1}
    assert wide == {
        "Prefill-Current": ".status.prefill.replicas",
        "Decode-Current": ".status.decode.replicas",
        "Prefill-Scaling": ".status.prefill.autoscaling.reason",
        "Decode-Scaling": ".status.decode.autoscaling.reason",
        "TTFT-ms": ".status.prefill.autoscaling.observedMilliseconds",
        "ITL-ms": ".status.decode.autoscaling.observedMilliseconds",
        "PD-Threshold": ".status.disaggregationThreshold.tokens",
    }
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert {"observedGeneration", "conditions", "prefill", "decode", "routerEndpoint", "kvCompatHash"} <= set(status)
    conditions = status["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert set(conditions["items"]["properties"]) >= {"type", "status", "reason", "message", "lastTransitionTime"}
