"""Kubernetes formats: what the API server would refuse in a child is refused in the PDService, at its field.

Each bad value below is one the API server refuses when the renderer copies it into a StatefulSet or Deployment
(nodeSelector, topologySpreadConstraints, affinity, tolerations, resources, env, the namespace). Whether the CRD
refuses the same values is checked against a real API server in test_rule_agreement.py.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest

from pdserve.api import kubeformats
from pdserve.api.crdgen import openapi_schema
from pdserve.api.v1alpha1 import PlacementSpec
from pdserve.api.validation import validate

BASE: dict[str, Any] = {
    "apiVersion": "pdserve.io/v1alpha1",
    "kind": "PDService",
    "metadata": {"name": "svc"},
    "spec": {"model": {"name": "m", "uri": "hf://org/m"}, "engine": {"image": "vllm:1"}},
}
NAME_63 = "n" * 63
NAME_64 = "n" * 64
VALUE_64 = "v" * 64


def doc(**patch: Any) -> dict[str, Any]:
    """BASE with `a__b=value` set at spec.a.b (`metadata__x` sets metadata.x)."""
    result = copy.deepcopy(BASE)
    for dotted, value in patch.items():
        *parents, leaf = dotted.split("__")
        node = result if parents and parents[0] == "metadata" else result["spec"]
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return result


# (case, spec, the field the problem must be reported at)
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("gpu node selector key with a space", doc(placement__gpuNodeSelector={"bad key!": "x"}), "gpuNodeSelector"),
    ("pool node selector value of 64", doc(decode__nodeSelector={"pool": VALUE_64}), "nodeSelector"),
    ("node selector value with a space", doc(prefill__nodeSelector={"pool": "a b"}), "nodeSelector"),
    ("router node selector key name of 64", doc(router__nodeSelector={f"example.com/{NAME_64}": "x"}), "nodeSelector"),
    ("node selector key prefix of 254", doc(router__nodeSelector={f"{'p' * 254}/name": "x"}), "nodeSelector"),
    ("topology key name of 64", doc(placement__topologyKey=f"example.com/{NAME_64}"), "topologyKey"),
    ("spread key with a space", doc(placement__spreadKey="kubernetes.io/host name"), "spreadKey"),
    ("rdma node label ending in a dash", doc(placement__rdmaNodeLabel="rdma-"), "rdmaNodeLabel"),
    ("toleration key with a space", doc(placement__tolerations=[{"key": "a b", "operator": "Exists"}]), "key"),
    ("toleration value of 64", doc(decode__tolerations=[{"key": "k", "value": VALUE_64}]), "value"),
    ("resource name with a space", doc(decode__resources={"requests": {"big cpu": "1"}}), "requests"),
    ("unprefixed resource that is not standard", doc(prefill__resources={"limits": {"gpu": "1"}}), "limits"),
    ("gpu resource without a domain", doc(placement__gpuResourceName="gpu"), "gpuResourceName"),
    ("rdma resource with upper case prefix", doc(prefill__rdma={"resourceName": "RDMA/ib"}), "resourceName"),
    ("env name with =", doc(engine__env=[{"name": "A=B", "value": "1"}]), "name"),
    ("env name with a non-ASCII letter", doc(decode__env=[{"name": "CAF\u00c9", "value": "1"}]), "name"),
    ("env name with a tab", doc(engine__env=[{"name": "A\tB", "value": "1"}]), "name"),
    ("namespace with upper case", doc(metadata__namespace="Team_A"), "metadata.namespace"),
    ("namespace of 64", doc(metadata__namespace="a" * 64), "metadata.namespace"),
    (
        "hub token secret with upper case",
        doc(model={"name": "m", "uri": "hf://o/m", "hfTokenSecret": "HF"}),
        "hfTokenSecret",
    ),
]
ADMITTED: list[tuple[str, dict[str, Any]]] = [
    ("label key and value at 63", doc(placement__gpuNodeSelector={f"example.com/{NAME_63}": VALUE_64[:63]})),
    ("empty label value", doc(decode__nodeSelector={"pool": ""})),
    ("prefix of 253", doc(placement__topologyKey=f"{('a' * 62 + '.') * 4}b/{NAME_63}")),
    ("hugepages and extended resources", doc(decode__resources={"limits": {"hugepages-2Mi": "1Gi", "x.io/d": "1"}})),
    ("relaxed env names", doc(engine__env=[{"name": "my.var-1 ~!", "value": "1"}, {"name": "1ABC", "value": "2"}])),
    ("empty toleration key with Exists", doc(placement__tolerations=[{"key": "", "operator": "Exists"}])),
    ("namespace", doc(metadata__namespace="team-a")),
]


@pytest.mark.parametrize(("case", "spec", "field"), REFUSED, ids=[c[0] for c in REFUSED])
def test_refused_at_the_field(case: str, spec: dict[str, Any], field: str) -> None:
    problems = validate(spec).problems
    assert problems, f"{case}: admitted"
    assert all(field in p.field for p in problems), problems
    assert all(len(str(p)) < 700 for p in problems), "a problem echoes a bounded part of the input"


@pytest.mark.parametrize(("case", "spec"), ADMITTED, ids=[c[0] for c in ADMITTED])
def test_valid_kubernetes_values_are_admitted(case: str, spec: dict[str, Any]) -> None:
    assert validate(spec).problems == ()


def test_a_bad_map_key_is_quoted_in_the_message() -> None:
    (problem,) = validate(doc(placement__gpuNodeSelector={"bad key!": "x"})).problems
    assert problem.field == "spec.placement.gpuNodeSelector"
    assert "'bad key!'" in problem.message and "label key" in problem.message


def test_a_hostile_key_is_not_echoed_at_length() -> None:
    (problem,) = validate(doc(placement__gpuNodeSelector={"!" * 100_000: "x"})).problems
    assert len(str(problem)) < 1000


@pytest.mark.parametrize(
    "fmt",
    [kubeformats.LABEL_KEY, kubeformats.LABEL_VALUE, kubeformats.CONTAINER_RESOURCE, kubeformats.ENV_VAR_NAME],
    ids=lambda f: f.what,
)
def test_formats_are_re2_compatible(fmt: kubeformats.Format) -> None:
    # RE2 (the API server's regex engine) has no look-around or backreferences.
    assert not re.search(r"\(\?[=!<]|\\[1-9]", fmt.regex)


def test_map_keys_are_checked_by_cel_in_the_crd() -> None:
    selector = openapi_schema(PlacementSpec)["properties"]["gpuNodeSelector"]
    assert "propertyNames" not in selector, "structural schemas have no propertyNames"
    (rule,) = selector["x-kubernetes-validations"]
    assert rule["rule"] == f"self.all(k, {kubeformats.LABEL_KEY.cel('k')})"
    assert selector["additionalProperties"]["maxLength"] == 63
    assert selector["maxProperties"] == kubeformats.MAX_MAP_ENTRIES
    topology = openapi_schema(PlacementSpec)["properties"]["topologyKey"]
    assert topology["pattern"] == kubeformats.LABEL_KEY.pattern
