"""status.inferencePool in router mode gateway: the pool read back, its parents' verdicts, no repeated writes."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import yaml

from pdserve.api.policy import DEFAULT_POLICY
from pdserve.api.settings import OperatorSettings
from pdserve_dev.testing.fake_kube import FakeKube
from pdserve_operator.gateway_status import REFRESH_SECONDS, inference_pool_status
from pdserve_operator.kinds import INFERENCE_POOL
from pdserve_operator.reconcile import Outcome, reconcile
from pdserve_operator.store import Store
from pdserve_operator.view import SpecViews

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gateway" / "pdservice.yaml"
NAMESPACE, NAME = "default", "llama"


def parent(name: str, accepted: str, resolved: str | None, reason: str = "Accepted") -> dict[str, Any]:
    conditions = [{"type": "Accepted", "status": accepted, "reason": reason, "message": f"{name} says {reason}"}]
    if resolved is not None:
        conditions.append({"type": "ResolvedRefs", "status": resolved, "reason": "ResolvedRefs", "message": ""})
    return {"parentRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway", "namespace": "infra",
                          "name": name}, "conditions": conditions}  # fmt: skip


def test_each_parent_is_reported_with_the_first_condition_that_is_not_true() -> None:
    pool = {"status": {"parents": [
        parent("public", "True", "True"),
        parent("internal", "False", None, reason="NotAllowedByListeners"),
        parent("new", "True", None),
    ]}}  # fmt: skip
    status = inference_pool_status("llama", pool)
    assert status == {
        "name": "llama",
        "parents": [
            {"parent": "Gateway/infra/public", "accepted": True, "resolvedRefs": True, "message": ""},
            {"parent": "Gateway/infra/internal", "accepted": False, "resolvedRefs": False,
             "message": "Accepted: NotAllowedByListeners: internal says NotAllowedByListeners"},
            {"parent": "Gateway/infra/new", "accepted": True, "resolvedRefs": False,
             "message": "ResolvedRefs: not reported yet"},
        ],
    }  # fmt: skip
    assert inference_pool_status("llama", None) == {"name": "llama", "parents": []}


class World:
    def __init__(self) -> None:
        self.kube, self.store = FakeKube(), Store()
        self.views = SpecViews(DEFAULT_POLICY)
        self._ticks = itertools.count()
        self.store.put_owner(self.kube.add_owner(yaml.safe_load(EXAMPLE.read_text())))

    def now(self) -> str:
        tick = next(self._ticks)
        return f"2026-01-01T00:{tick // 60 % 60:02d}:{tick % 60:02d}Z"

    def reconcile(self) -> Outcome:
        return reconcile(
            NAMESPACE,
            NAME,
            self.store,
            self.kube,
            self.now,
            views=self.views,
            crash_window=OperatorSettings.crash_recovery_seconds,
        )

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = self.kube.owner(NAMESPACE, NAME)["status"]
        return status


def test_reconcile_applies_the_pool_once_and_reports_what_its_gateway_wrote() -> None:
    world = World()
    first = world.reconcile()
    assert any(label.startswith("InferencePool llama") for label in first.applied)
    assert world.status()["inferencePool"] == {"name": "llama", "parents": []}
    assert first.requeue_after is not None and first.requeue_after <= REFRESH_SECONDS
    # The discovery ConfigMap lists the owned Services' UIDs, known once they exist: one more pass publishes them.
    settle = world.reconcile()
    assert settle.applied == ["ConfigMap llama-router-discovery (changed)"]
    # A gateway accepts the pool (it writes the pool's status; the operator does not watch pools).
    pool = world.kube.objects[(INFERENCE_POOL.kind, NAMESPACE, NAME)]
    pool["status"] = {"parents": [parent("public", "True", "True")]}
    second = world.reconcile()
    assert not any(label.startswith("InferencePool") for label in second.applied), "the pool was applied again"
    assert world.status()["inferencePool"]["parents"] == [
        {"parent": "Gateway/infra/public", "accepted": True, "resolvedRefs": True, "message": ""}
    ]
    third = world.reconcile()
    assert not third.status_written


def test_an_inference_pool_another_owner_made_under_the_pools_name_is_a_conflict() -> None:
    """The pool is never in the informer cache (its CRD is optional, so it is not watched): it is read by name on
    every pass, and one of that name without this PDService's controller reference is never taken over."""
    world = World()
    theirs = world.kube.add_object(
        {
            "apiVersion": INFERENCE_POOL.api_version,
            "kind": INFERENCE_POOL.kind,
            "metadata": {"name": NAME, "namespace": NAMESPACE},
            "spec": {"selector": {"matchLabels": {"team": "b"}}, "targetPorts": [{"number": 8000}]},
        }
    )
    outcome = world.reconcile()
    assert outcome.applied == []
    assert world.kube.objects[(INFERENCE_POOL.kind, NAMESPACE, NAME)] == theirs
    degraded = next(c for c in world.status()["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ChildConflict")
    assert f"InferencePool {NAME} exists and is not controlled by any owner" in degraded["message"]
