"""The planner against rendered objects: creates, no-ops, updates, prunes, autoscaled replicas."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from pdserve.api.defaults import effective
from pdserve.api.kvcompat import kv_compat_hash
from pdserve.api.v1alpha1 import PDService
from pdserve.api.validation import validate
from pdserve_operator import plan
from pdserve_operator.kinds import STATEFUL_SET
from pdserve_operator.observed import ObjectKey, key_of
from pdserve_operator.render import render

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pdservice.yaml"
UID = "11111111-2222-3333-4444-555555555555"


def example(**patch: Any) -> PDService:
    document = yaml.safe_load(EXAMPLE.read_text())
    document["metadata"]["uid"] = UID
    for dotted, value in patch.items():
        target = document
        *path, last = dotted.split("__")
        for part in path:
            target = target.setdefault(part, {})
        target[last] = value
    return PDService.model_validate(document)


def desired_of(pds: PDService, observed: dict[ObjectKey, dict[str, Any]]) -> list[dict[str, Any]]:
    """What a pass applies for `pds`: its render, adjusted for what the cluster holds (`observed`), stamped."""
    checked = validate(pds)
    return plan.desired_objects(checked.require()[1], render(checked), observed)


def as_observed(objects: list[dict[str, Any]]) -> dict[ObjectKey, dict[str, Any]]:
    """What the API server would return: our fields plus server-set metadata and defaults."""
    observed = {}
    for index, obj in enumerate(objects):
        stored = copy.deepcopy(obj)
        stored["metadata"].update(uid=f"uid-{index}", resourceVersion=str(100 + index), generation=1)
        stored.setdefault("status", {})
        observed[key_of(stored)] = stored
    return observed


def test_first_pass_creates_everything_in_render_order() -> None:
    pds = example()
    desired = desired_of(pds, {})
    result = plan.make_plan(desired, {}, UID)
    assert [a.obj["kind"] for a in result.applies] == [o["kind"] for o in render(validate(pds))]
    assert {a.reason for a in result.applies} == {"missing"}
    assert not result.prunes


def test_second_pass_is_a_noop() -> None:
    pds = example()
    desired = desired_of(pds, {})
    observed = as_observed(desired)
    again = desired_of(pds, observed)
    assert plan.make_plan(again, observed, UID).empty


def test_image_change_updates_only_the_changed_children() -> None:
    pds = example()
    observed = as_observed(desired_of(pds, {}))
    newer = example(spec__engine__image="vllm/vllm-openai:v0.33.0")
    old, new = (kv_compat_hash(effective(p.spec)) for p in (pds, newer))
    result = plan.make_plan(desired_of(newer, observed), observed, UID)
    # The image is part of the kv-compat value: the router's per-value Services follow it. Here no pod carries the
    # old value (nothing observed), so its Services go; `test_operator_router_discovery` has the rollout.
    assert sorted((a.obj["kind"], a.obj["metadata"]["name"], a.reason) for a in result.applies) == [
        ("Service", f"llama-8b-decode-{new}", "missing"),
        ("Service", f"llama-8b-prefill-{new}", "missing"),
        ("StatefulSet", "llama-8b-decode", "changed"),
        ("StatefulSet", "llama-8b-prefill", "changed"),
    ]
    assert sorted(p.name for p in result.prunes) == [f"llama-8b-decode-{old}", f"llama-8b-prefill-{old}"]


def test_drift_is_reverted() -> None:
    pds = example()
    observed = as_observed(desired_of(pds, {}))
    key = ("StatefulSet", "default", "llama-8b-prefill")
    observed[key]["spec"]["template"]["spec"]["containers"][0]["image"] = "evil:latest"
    service_key = ("Service", "default", "llama-8b-router")
    del observed[service_key]
    result = plan.make_plan(desired_of(pds, observed), observed, UID)
    assert sorted((a.obj["kind"], a.obj["metadata"]["name"], a.reason) for a in result.applies) == [
        ("Service", "llama-8b-router", "missing"),
        ("StatefulSet", "llama-8b-prefill", "drift at spec.template.spec.containers[vllm].image"),
    ]


def test_prunes_only_owned_leftovers() -> None:
    pds = example()
    observed = as_observed(desired_of(pds, {}))
    owned: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "llama-8b-old",
            "namespace": "default",
            "uid": "cm-uid",
            "ownerReferences": [{"uid": UID, "controller": True}],
        },
    }
    foreign = copy.deepcopy(owned)
    foreign["metadata"].update(name="llama-8b-foreign", uid="x", ownerReferences=[{"uid": "other", "controller": True}])
    observed[key_of(owned)] = owned
    observed[key_of(foreign)] = foreign
    result = plan.make_plan(desired_of(pds, observed), observed, UID)
    assert not result.applies
    assert [(p.kind.kind, p.name, p.uid) for p in result.prunes] == [("ConfigMap", "llama-8b-old", "cm-uid")]


def test_autoscaled_pool_keeps_the_autoscalers_replicas_within_bounds() -> None:
    pds = example(spec__decode__autoscaling={"enabled": True, "minReplicas": 2, "maxReplicas": 12})
    observed = as_observed(desired_of(pds, {}))
    key = ("StatefulSet", "default", "llama-8b-decode")
    for scaled, expected in [(7, 7), (40, 12), (1, 2)]:
        observed[key]["spec"]["replicas"] = scaled
        desired = desired_of(pds, observed)
        sts = next(o for o in desired if key_of(o) == key)
        assert sts["spec"]["replicas"] == expected
        result = plan.make_plan(desired, observed, UID)
        # Inside the bounds the autoscaler's value is left alone: no write at all.
        assert (len(result.applies) == 0) == (scaled == expected)
        assert all(a.kind == STATEFUL_SET for a in result.applies)
    # The non-autoscaled pool is still enforced.
    prefill = ("StatefulSet", "default", "llama-8b-prefill")
    observed[prefill]["spec"]["replicas"] = 9
    desired = desired_of(pds, observed)
    assert next(o for o in desired if key_of(o) == prefill)["spec"]["replicas"] == 2


def test_waves_put_workloads_after_what_they_reference() -> None:
    pds = example()
    result = plan.make_plan(desired_of(pds, {}), {}, UID)
    first, second = result.waves()
    assert {a.obj["kind"] for a in second} == {"StatefulSet", "Deployment"}
    assert not {a.obj["kind"] for a in first} & {"StatefulSet", "Deployment"}
    assert len(first) + len(second) == len(result.applies)


def test_a_name_held_by_another_owner_is_a_conflict_and_nothing_is_written() -> None:
    """Objects of a child's name that the PDService does not control (no controller reference, or another
    owner's, or a deleted predecessor's) are never applied over; a plan with one applies and prunes nothing."""
    pds = example()
    desired = desired_of(pds, {})
    observed = as_observed(desired)
    leftover = copy.deepcopy(observed[("ConfigMap", "default", "llama-8b-router")])
    leftover["metadata"]["name"] = "llama-8b-leftover"
    observed[key_of(leftover)] = leftover  # an owned leftover: would be pruned
    role = ("Role", "default", "llama-8b-router")
    theirs = copy.deepcopy(observed[role])
    theirs["metadata"]["ownerReferences"] = []
    theirs["metadata"]["managedFields"] = [{"manager": "kubectl-create"}, {"manager": "kubectl-edit"}]
    other = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "team-b", "uid": "u-b", "controller": True}
    service = ("Service", "default", "llama-8b-router")
    held_by_deployment = copy.deepcopy(observed[service])
    held_by_deployment["metadata"]["ownerReferences"] = [other]
    config = ("ConfigMap", "default", "llama-8b-router")
    predecessor = copy.deepcopy(observed[config])
    predecessor["metadata"]["ownerReferences"][0]["uid"] = "deleted"

    result = plan.make_plan(
        desired, {**observed, role: theirs}, UID, {service: held_by_deployment, config: predecessor}
    )
    assert result.applies == [] and result.prunes == []
    assert sorted(conflict.kind for conflict in result.conflicts) == ["ConfigMap", "Role", "Service"]
    by_kind = {conflict.kind: conflict for conflict in result.conflicts}
    assert by_kind["Role"].describe() == (
        "Role llama-8b-router exists and is not controlled by any owner, written by kubectl-create, kubectl-edit"
    )
    assert by_kind["Service"].describe() == (
        "Service llama-8b-router exists and is controlled by Deployment team-b (uid u-b)"
    )
    assert by_kind["ConfigMap"].holder.predecessor and not by_kind["Role"].holder.predecessor
