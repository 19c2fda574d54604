"""The reconcile's IO step on its own: a plan's writes, their Events and the cache, and the status patch.

`FakeKube` (pdserve_dev.testing.fake_kube) fakes the writes, not the API server (the cluster tests cover what the
server does with them); the plans are the planner's own, for examples/pdservice.yaml.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.api.validation import validate
from pdserve_dev.testing.fake_kube import FakeKube
from pdserve_operator.executor import RetryLaterError, execute, write_status
from pdserve_operator.kinds import CONFIG_MAP
from pdserve_operator.plan import WORKLOAD_KINDS, Plan, Prune, desired_objects, make_plan
from pdserve_operator.render import render
from pdserve_operator.store import Store

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pdservice.yaml"
NAMESPACE, NAME = "default", "llama-8b"
NOW = "2026-01-01T00:00:00Z"


def owner(kube: FakeKube) -> dict[str, Any]:
    return kube.add_owner(yaml.safe_load(EXAMPLE.read_text()))


def first_plan(body: dict[str, Any]) -> Plan:
    """What the first pass over `body` plans: create every child."""
    checked = validate({k: v for k, v in body.items() if k != "status"})
    return make_plan(desired_objects(checked.require()[1], render(checked), {}), {}, body["metadata"]["uid"])


def test_every_planned_object_is_applied_in_waves_cached_and_announced_once() -> None:
    kube, store = FakeKube(), Store()
    body = owner(kube)
    store.put_owner(body)
    plan = first_plan(body)
    done = execute(plan, body, store, kube, applier=None, now=lambda: NOW)
    applies = [call for call in kube.calls if call.verb == "apply"]
    assert [call.name for call in applies] == [a.obj["metadata"]["name"] for wave in plan.waves() for a in wave]
    first_workload = next(i for i, call in enumerate(applies) if call.kind in WORKLOAD_KINDS)
    assert all(call.kind in WORKLOAD_KINDS for call in applies[first_workload:])
    assert len(done.applied) == len(plan.applies) and done.pruned == [] and done.refused == done.transient == []
    # The cache holds what the server answered (its resourceVersion), before any watch event.
    sts = store.snapshot(NAMESPACE, NAME).child("StatefulSet", NAMESPACE, f"{NAME}-decode")
    assert sts is not None and sts["metadata"]["resourceVersion"]
    # One Event for all the creates, not one per object.
    assert [(e["type"], e["reason"]) for e in kube.events] == [("Normal", "Applied")]
    assert kube.events[0]["message"].startswith("Created ServiceAccount llama-8b-router, ")
    assert done.events == [f"Normal Applied: {kube.events[0]['message']}"]


def test_a_refused_write_is_collected_and_the_others_go_on() -> None:
    kube, store = FakeKube(), Store()
    body = owner(kube)
    kube.fail("apply", 422, "spec.template: Invalid value", kind="StatefulSet", name=f"{NAME}-decode")
    kube.fail("apply", 500, "etcdserver: leader changed", kind="StatefulSet", name=f"{NAME}-prefill")
    plan = first_plan(body)
    done = execute(plan, body, store, kube, applier=None, now=lambda: NOW)
    assert done.refused == [f"StatefulSet {NAME}-decode: HTTP 422 Invalid: spec.template: Invalid value"]
    assert [t.split(":")[0] for t in done.transient] == [f"StatefulSet {NAME}-prefill"]
    assert len(done.applied) == len(plan.applies) - 2
    assert store.snapshot(NAMESPACE, NAME).child("StatefulSet", NAMESPACE, f"{NAME}-decode") is None


def test_a_prune_deletes_under_the_uid_and_says_why() -> None:
    kube, store = FakeKube(), Store()
    body = owner(kube)
    leftover = kube.apply(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": f"{NAME}-old", "namespace": NAMESPACE, "labels": {"app.kubernetes.io/instance": NAME}},
        }
    )
    store.put(leftover)
    plan = Plan(prunes=[Prune(CONFIG_MAP, NAMESPACE, f"{NAME}-old", leftover["metadata"]["uid"])])
    done = execute(plan, body, store, kube, applier=None, now=lambda: NOW)
    assert done.pruned == [f"ConfigMap {NAME}-old"]
    assert ("ConfigMap", NAMESPACE, f"{NAME}-old") not in kube.objects
    assert store.snapshot(NAMESPACE, NAME).children == {}
    assert [(e["reason"], e["message"]) for e in kube.events] == [
        ("Pruned", f"Deleted ConfigMap {NAME}-old: the spec no longer produces them")
    ]


def test_the_status_patch_is_cached_gone_is_fine_and_a_failure_is_retried() -> None:
    kube, store = FakeKube(), Store()
    body = owner(kube)
    assert write_status(body, {"observedGeneration": 1}, store, kube)
    cached = store.owner(NAMESPACE, NAME)
    assert cached is not None and cached["status"] == {"observedGeneration": 1}
    kube.fail("status", 500, "etcdserver: request timed out", times=1)
    with pytest.raises(RetryLaterError, match=r"status: .*request timed out"):
        write_status(body, {"observedGeneration": 2}, store, kube)
    del kube.objects[("PDService", NAMESPACE, NAME)]  # deleted meanwhile
    assert not write_status(body, {"observedGeneration": 2}, store, kube)
