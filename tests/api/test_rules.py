"""The cross-field rule table: each rule catches its violation at its field with its one message, lets its boundary
case through, is in the CRD as CEL at the right node, and quotes the defaults table instead of repeating it.

Whether the CEL and the Python of each rule agree is checked against a real API server in test_rule_agreement.py.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest

from pdserve.api import rules
from pdserve.api.crdgen import openapi_schema
from pdserve.api.defaulting import default_of
from pdserve.api.defaults import EffectiveAutoscaling, EffectiveEngine, EffectivePool
from pdserve.api.policy import Policy
from pdserve.api.rules import RULES, CrossFieldRule, cel_or_default
from pdserve.api.validation import Problem, validate

BASE: dict[str, Any] = {
    "apiVersion": "pdserve.io/v1alpha1",
    "kind": "PDService",
    "metadata": {"name": "svc"},
    "spec": {"model": {"name": "m", "uri": "hf://org/m"}, "engine": {"image": "vllm:1"}},
}
ENV_FROM = {"fieldRef": {"fieldPath": "spec.nodeName"}}
# The node-path rules hold whatever an administrator allows; their boundary cases need a node path that is allowed.
POLICY = Policy.allowing(model_host_paths=["/mnt/models"])


def doc(**patch: Any) -> dict[str, Any]:
    """BASE with `a__b=value` set at spec.a.b."""
    result = copy.deepcopy(BASE)
    for dotted, value in patch.items():
        node = result["spec"]
        *parents, leaf = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return result


# rule name -> (a spec breaking only that rule, the path of the object it applies to, a spec just inside the rule)
EXAMPLES: dict[str, tuple[dict[str, Any], str, dict[str, Any]]] = {
    "env-value-or-value-from": (
        doc(prefill__env=[{"name": "A", "value": "1", "valueFrom": ENV_FROM}]),
        "spec.prefill.env[0]",
        doc(prefill__env=[{"name": "A", "value": "", "valueFrom": ENV_FROM}]),
    ),
    "toleration-empty-key-needs-exists": (
        doc(decode__tolerations=[{"effect": "NoSchedule"}]),
        "spec.decode.tolerations[0]",
        doc(decode__tolerations=[{"operator": "Exists", "effect": "NoSchedule"}]),
    ),
    "toleration-exists-has-no-value": (
        doc(placement__tolerations=[{"key": "k", "operator": "Exists", "value": "v"}]),
        "spec.placement.tolerations[0]",
        doc(placement__tolerations=[{"key": "k", "operator": "Exists", "value": ""}]),
    ),
    "toleration-seconds-needs-no-execute": (
        doc(router__tolerations=[{"key": "k", "effect": "NoSchedule", "tolerationSeconds": 5}]),
        "spec.router.tolerations[0]",
        doc(router__tolerations=[{"key": "k", "effect": "NoExecute", "tolerationSeconds": 5}]),
    ),
    "revision-needs-hf": (
        doc(model={"name": "m", "uri": "pvc://claim/m", "revision": "main"}),
        "spec.model",
        doc(model={"name": "m", "uri": "hf://org/m", "revision": "main"}),
    ),
    "model-node-path-normalised": (
        doc(model={"name": "m", "uri": "/mnt/models/../llama"}),
        "spec.model",
        doc(model={"name": "m", "uri": "/mnt/models/..llama/.cache"}),
    ),
    "model-node-path-not-system": (
        # Contains /var/lib/kubelet.
        doc(model={"name": "m", "uri": "/var/lib"}),
        "spec.model",
        doc(model={"name": "m", "uri": "/mnt/models/var/lib/kubelet"}),
    ),
    "autoscaling-min-le-max": (
        # Only the table's default maxReplicas (8) makes this invalid.
        doc(prefill__autoscaling={"minReplicas": 9}),
        "spec.prefill.autoscaling",
        doc(prefill__autoscaling={"minReplicas": 8}),
    ),
    "ratio-min-le-max": (
        doc(autoscaling={"prefillToDecodeRatio": {"min": 2, "max": 0.5}}),
        "spec.autoscaling.prefillToDecodeRatio",
        doc(autoscaling={"prefillToDecodeRatio": {"min": 0.5, "max": 0.5}}),
    ),
    "threshold-min-le-max": (
        doc(autoscaling={"disaggregationThreshold": {"minTokens": 2048, "maxTokens": 512}}),
        "spec.autoscaling.disaggregationThreshold",
        doc(autoscaling={"disaggregationThreshold": {"minTokens": 512, "maxTokens": 512}}),
    ),
    "colocation-needs-topology-key": (
        doc(placement={"colocation": "preferred"}),
        "spec.placement",
        doc(placement={"colocation": "none"}),
    ),
    "store-settings-need-backend": (
        doc(engine__kvCache={"store": {"mooncake": {"protocol": "tcp"}}}),
        "spec.engine.kvCache.store",
        doc(engine__kvCache={"store": {"backend": "mooncake", "mooncake": {"protocol": "tcp"}}}),
    ),
    "mooncake-metadata-needs-address": (
        doc(engine__kvCache={"store": {"backend": "mooncake", "mooncake": {"metadataServer": "http://m/metadata"}}}),
        "spec.engine.kvCache.store.mooncake",
        doc(
            engine__kvCache={
                "store": {
                    "backend": "mooncake",
                    "mooncake": {"masterAddress": "m:50051", "metadataServer": "http://m/metadata"},
                }
            }
        ),
    ),
    "mooncake-deployed-settings-without-address": (
        doc(engine__kvCache={"store": {"backend": "mooncake", "mooncake": {"masterAddress": "m:1", "image": "mc:1"}}}),
        "spec.engine.kvCache.store.mooncake",
        doc(engine__kvCache={"store": {"backend": "mooncake", "mooncake": {"image": "mc:1", "capacityBytes": "1Gi"}}}),
    ),
    "prefill-tp-le-decode-tp": (
        # Only the table's default decode TP (1) makes this invalid.
        doc(prefill__tensorParallelSize=2),
        "spec",
        doc(prefill__tensorParallelSize=2, engine__attention="mla"),
    ),
    "gateway-sidecar-port-free": (
        # Only the table's default engine port (8000) makes this invalid.
        doc(router={"mode": "gateway", "gateway": {"sidecarPort": 8000}}),
        "spec",
        doc(router={"mode": "gateway", "gateway": {"sidecarPort": 8001}}),
    ),
}


def test_every_rule_has_an_example() -> None:
    assert set(EXAMPLES) == {rule.name for rule in RULES}
    assert len({rule.name for rule in RULES}) == len(RULES), "rule names are ids: keep them unique"


@pytest.mark.parametrize("rule", RULES, ids=[rule.name for rule in RULES])
def test_rule_reports_its_violation_at_its_field(rule: CrossFieldRule[Any]) -> None:
    broken, at, _ = EXAMPLES[rule.name]
    assert validate(broken, POLICY).problems == (Problem(f"{at}.{rule.field}", rule.message),)


@pytest.mark.parametrize("rule", RULES, ids=[rule.name for rule in RULES])
def test_rule_admits_its_boundary_case(rule: CrossFieldRule[Any]) -> None:
    _, _, fine = EXAMPLES[rule.name]
    assert validate(fine, POLICY).problems == ()


@pytest.mark.parametrize("rule", RULES, ids=[rule.name for rule in RULES])
def test_a_broken_rule_is_noticed(rule: CrossFieldRule[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The examples depend on each rule: with its predicate made to always hold, its violation goes through."""
    neutered = dataclasses.replace(rule, holds=lambda _: True)
    others = tuple(r for r in rules.BY_MODEL[rule.model] if r is not rule)
    monkeypatch.setitem(rules.BY_MODEL, rule.model, (*others, neutered))
    broken, _, _ = EXAMPLES[rule.name]
    assert validate(broken, POLICY).problems == ()


@pytest.mark.parametrize("rule", RULES, ids=[rule.name for rule in RULES])
def test_rule_is_cel_on_its_model_in_the_crd(rule: CrossFieldRule[Any]) -> None:
    validations = openapi_schema(rule.model).get("x-kubernetes-validations", [])
    assert {"rule": rule.cel, "message": rule.message, "fieldPath": f".{rule.field}"} in validations
    # The field path must exist in the schema, or the API server refuses the CRD.
    node = openapi_schema(rule.model)
    for step in rule.field.split("."):
        node = node["properties"][step]


def test_cel_quotes_the_defaults_table() -> None:
    by_name = {rule.name: rule for rule in RULES}
    low, high = default_of(EffectiveAutoscaling, "min_replicas"), default_of(EffectiveAutoscaling, "max_replicas")
    bounds = by_name["autoscaling-min-le-max"]
    assert bounds.cel == f"(has(self.minReplicas) ? self.minReplicas : {low}) <= " + (
        f"(has(self.maxReplicas) ? self.maxReplicas : {high})"
    )
    assert f"maxReplicas {high}" in bounds.message
    tp = by_name["prefill-tp-le-decode-tp"]
    tp_default = default_of(EffectivePool, "tensor_parallel_size")
    assert cel_or_default("decode.tensorParallelSize", tp_default) in tp.cel
    assert f": '{default_of(EffectiveEngine, 'attention')}')" in tp.cel


def test_cel_or_default() -> None:
    assert cel_or_default("a", 1) == "(has(self.a) ? self.a : 1)"
    assert cel_or_default("a.b", "x") == "((has(self.a) && has(self.a.b)) ? self.a.b : 'x')"
    assert cel_or_default("a", "it's") == "(has(self.a) ? self.a : 'it\\'s')"
