"""The no-op detector: what counts as "observed still matches what we applied"."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve_operator import drift

SERVER_DEFAULTED_STS: dict[str, Any] = {
    "spec": {
        "replicas": 2,
        "revisionHistoryLimit": 10,
        "template": {
            "metadata": {"labels": {"a": "1"}, "annotations": {"kubectl.kubernetes.io/restartedAt": "now"}},
            "spec": {
                "containers": [
                    {
                        "name": "vllm",
                        "image": "img:1",
                        "args": ["x", "--port", "8000"],
                        "env": [
                            {"name": "A", "value": "1"},
                            {"name": "POD", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "x"}}},
                            {"name": "ADDED_BY_SOMEONE", "value": "z"},
                        ],
                        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}},
                        "terminationMessagePath": "/dev/termination-log",
                    }
                ],
                "dnsPolicy": "ClusterFirst",
            },
        },
    }
}


def desired_sts(**container: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "name": "vllm",
        "image": "img:1",
        "args": ["x", "--port", "8000"],
        "env": [{"name": "A", "value": "1"}, {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}],
        "resources": {"requests": {"cpu": "0.5", "memory": "1Gi"}},
    }
    base.update(container)
    return {
        "spec": {
            "replicas": 2,
            "template": {"metadata": {"labels": {"a": "1"}}, "spec": {"containers": [base], "tolerations": []}},
        }
    }


@pytest.mark.parametrize(
    ("desired", "difference"),
    [
        (desired_sts(), None),  # server defaults, other managers' env and annotations, quantity spelling
        (desired_sts(image="img:2"), "spec.template.spec.containers[vllm].image"),
        (desired_sts(args=["x", "--port", "9000"]), "spec.template.spec.containers[vllm].args[2]"),
        (desired_sts(args=["x"]), "spec.template.spec.containers[vllm].args"),
        (desired_sts(env=[{"name": "A", "value": "2"}]), "spec.template.spec.containers[vllm].env[A].value"),
        (desired_sts(env=[{"name": "NEW", "value": "1"}]), "spec.template.spec.containers[vllm].env[NEW]"),
        (
            desired_sts(resources={"requests": {"cpu": "1"}}),
            "spec.template.spec.containers[vllm].resources.requests.cpu",
        ),
    ],
)
def test_first_difference(desired: dict[str, Any], difference: str | None) -> None:
    assert drift.first_difference(desired, SERVER_DEFAULTED_STS) == difference


@pytest.mark.parametrize(
    ("want", "have", "equal"),
    [
        ("1", "1", True),
        ("0.5", "500m", True),
        ("1024Mi", "1Gi", True),
        ("1", "2", False),
        (1, "1", True),  # an int-or-string written as a number and read back as text is the same quantity
        (True, 1, False),
        ("None", "None", True),
        ("abc", "abd", False),
        (None, "anything", True),  # we do not set it
        ({}, {"x": 1}, True),
        ([], None, True),  # omitempty dropped it
        ([], ["a"], False),  # an atomic list we set empty was filled by someone
        ("", None, True),  # omitempty dropped an empty string (env value "", toleration key "")
        ("", "x", False),  # someone set a string we keep empty
    ],
)
def test_scalars_and_empties(want: Any, have: Any, equal: bool) -> None:
    assert drift.contains({"f": want}, {"f": have}) is equal


def test_stamp_and_reason() -> None:
    obj = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s", "namespace": "n"}, "spec": {"a": 1}}
    stamped = drift.stamp(obj)
    assert drift.applied_hash(stamped) == drift.applied_hash(obj)  # the annotation does not feed the hash
    assert drift.apply_reason(stamped, None) == "missing"
    observed = {**stamped, "metadata": {**stamped["metadata"], "uid": "u", "resourceVersion": "5"}}
    assert drift.apply_reason(stamped, observed) is None
    changed = drift.stamp({**obj, "spec": {"a": 2}})
    assert drift.apply_reason(changed, observed) == "changed"
    drifted = {**observed, "spec": {"a": 3}}
    assert drift.apply_reason(stamped, drifted) == "drift at spec.a"
    # A field we stopped setting is only visible through the hash.
    smaller = drift.stamp({**obj, "spec": {}})
    assert drift.apply_reason(smaller, observed) == "changed"


def test_empty_strings_round_trip_without_drift() -> None:
    """Go's `omitempty` drops empty strings on read-back: an env var with value "" or a toleration with key ""
    comes back without that field. Taken for drift, it would be re-applied (and an event posted) on every pass."""
    desired = desired_sts(env=[{"name": "EMPTY", "value": ""}])
    desired["spec"]["template"]["spec"]["tolerations"] = [{"key": "", "operator": "Exists"}]
    observed = desired_sts(env=[{"name": "EMPTY"}])
    observed["spec"]["template"]["spec"]["tolerations"] = [{"operator": "Exists"}]
    assert drift.first_difference(desired, observed) is None
