"""The operator's failure contract: `reconcile()` scenario by scenario against a fake of its IO layer; and its
pure steps (`plan_writes`, `status_intent`, `transition_events`) on their own, without any IO.

`FakeKube` (pdserve_dev.testing.fake_kube) fakes the four writes a reconcile makes, not the API server: what the
server itself does with an object (validation, defaulting, field ownership) is covered by the cluster tests against
the real kube-apiserver. Here each scenario sets up the world (a PDService, the informer cache the operator would
keep, injected failures, a Lease that runs out), runs passes and checks what was written, in which order, and
what was raised. Every scenario runs with the apply thread pool the runner uses and with inline applies.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.api.kvcompat import kv_compat_hash
from pdserve.api.policy import DEFAULT_POLICY
from pdserve.api.settings import OperatorSettings
from pdserve.api.validation import validate
from pdserve_dev.testing.fake_kube import Call, FakeKube
from pdserve_dev.testing.owners import controlled
from pdserve_operator.kube import NotLeaderError
from pdserve_operator.observed import Snapshot, key_of
from pdserve_operator.plan import WORKLOAD_KINDS
from pdserve_operator.reconcile import (
    CONFLICT_RECHECK_S,
    ForeignPods,
    Outcome,
    RetryLaterError,
    plan_writes,
    reconcile,
    status_intent,
    transition_events,
)
from pdserve_operator.render import NOTHING_OBSERVED, render
from pdserve_operator.store import Store
from pdserve_operator.view import SpecViews, spec_document

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pdservice.yaml"
NAMESPACE, NAME = "default", "llama-8b"
# The first pass creates the per-kv-compat Services; the next one publishes their UIDs in the router's discovery
# ConfigMap (`render.discovery.owned_services`: a UID is known only once its Service exists).
PUBLISH_UIDS = f"apply ConfigMap {NAME}-router-discovery ok"
REFUSAL = 'StatefulSet.apps "llama-8b-decode" is invalid: spec.template.spec.containers[0].image: Required value'


def document() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    return loaded


def invalid(doc: dict[str, Any]) -> dict[str, Any]:
    """Passes the CRD, fails pdserve's semantic validation: a TP-2 engine on a 1-GPU pod."""
    doc["spec"]["prefill"].update(tensorParallelSize=2, gpusPerPod=1)
    doc["spec"]["decode"]["tensorParallelSize"] = 2
    return doc


def children_count() -> int:
    return len(render(validate(document())))


class World:
    """The fake IO layer, the informer cache, a ticking clock, and reconcile passes over them."""

    def __init__(self, applier: Executor | None) -> None:
        self.kube = FakeKube()
        self.store = Store()
        self.views = SpecViews(DEFAULT_POLICY)
        self.applier = applier
        self._ticks = itertools.count()

    def now(self) -> str:
        # A clock that moves on every call: a pass must not write just because time passed.
        tick = next(self._ticks)
        return f"2026-01-01T{tick // 3600 % 24:02d}:{tick // 60 % 60:02d}:{tick % 60:02d}Z"

    def put_spec(self, doc: dict[str, Any]) -> None:
        """`kubectl apply` of the PDService, and its watch event reaching the cache."""
        self.store.put_owner(self.kube.add_owner(doc))

    def pool_pod(self, pod: dict[str, Any]) -> dict[str, Any]:
        """`pod` as its pool's StatefulSet (which must exist) made it: controlled by it."""
        role = pod["metadata"]["labels"]["pdserve.io/role"]
        return controlled(pod, self.kube.objects[("StatefulSet", NAMESPACE, f"{NAME}-{role}")])

    def watch(self, objects: list[dict[str, Any]]) -> None:
        """Watch events of objects changed by someone else (the workload controllers)."""
        for obj in objects:
            self.store.put(obj)

    def reconcile(self) -> Outcome:
        return reconcile(
            NAMESPACE,
            NAME,
            self.store,
            self.kube,
            self.now,
            views=self.views,
            crash_window=OperatorSettings.crash_recovery_seconds,
            applier=self.applier,
        )

    def pass_calls(self) -> tuple[Outcome, list[Call]]:
        mark = self.kube.mark()
        outcome = self.reconcile()
        return outcome, self.kube.calls_since(mark)

    def converge(self) -> None:
        """Create everything, publish the Services' UIDs, let the controllers roll it out, record the final
        status."""
        self.put_spec(document())
        self.reconcile()
        self.reconcile()
        self.watch(self.kube.finish_rollouts())
        self.reconcile()

    def condition(self, type_: str) -> dict[str, Any]:
        status = self.kube.owner(NAMESPACE, NAME).get("status") or {}
        found = [c for c in status.get("conditions", []) if c["type"] == type_]
        assert len(found) == 1, status
        return dict(found[0])

    def warnings(self, reason: str) -> list[dict[str, Any]]:
        return [e for e in self.kube.events if e["type"] == "Warning" and e["reason"] == reason]


@pytest.fixture(params=["pool", "inline"])
def world(request: pytest.FixtureRequest) -> Iterator[World]:
    if request.param == "inline":
        yield World(None)
        return
    with ThreadPoolExecutor(max_workers=8, thread_name_prefix="test-apply") as pool:
        yield World(pool)


def verbs(calls: list[Call], predicate: Callable[[Call], bool] = lambda call: True) -> list[str]:
    return [f"{call.verb} {call.kind} {call.name} {call.outcome}" for call in calls if predicate(call)]


# ----------------------------------------------------------------------------------------------------- no-op


def test_first_pass_applies_every_child_once_then_writes_status(world: World) -> None:
    world.put_spec(document())
    outcome, calls = world.pass_calls()
    assert outcome.result == "applied"
    applies = [call for call in calls if call.verb == "apply"]
    assert len(applies) == children_count()
    assert all(call.written for call in calls)
    # Workloads only after everything they reference (wave order), status after all applies.
    first_workload = next(i for i, call in enumerate(applies) if call.kind in WORKLOAD_KINDS)
    assert all(call.kind in WORKLOAD_KINDS for call in applies[first_workload:])
    assert max(i for i, c in enumerate(calls) if c.verb == "apply") < calls.index(
        next(c for c in calls if c.verb == "status")
    )
    assert world.condition("Progressing")["reason"] == "Applying"


def test_a_pass_over_an_unchanged_world_writes_nothing(world: World) -> None:
    world.converge()
    assert world.condition("Progressing") | {"lastTransitionTime": ""} == {
        "type": "Progressing",
        "status": "False",
        "reason": "Complete",
        "message": "all children are up to date",
        "observedGeneration": 1,
        "lastTransitionTime": "",
    }
    for _ in range(3):
        outcome, calls = world.pass_calls()
        assert (outcome.result, calls) == ("noop", [])
    # The watch event of our own status patch (a newer resourceVersion of the owner) changes nothing either.
    world.store.put_owner(world.kube.owner(NAMESPACE, NAME))
    assert world.pass_calls()[1] == []


def test_a_deleted_pdservice_is_gone_without_writes(world: World) -> None:
    world.converge()
    world.store.delete_owner(NAMESPACE, NAME)
    outcome, calls = world.pass_calls()
    assert (outcome.result, calls) == ("gone", [])


# ----------------------------------------------------------------------------------------- refused (4xx)


@pytest.mark.parametrize("code", [400, 403, 404, 422])
def test_a_refused_apply_is_reported_once(world: World, code: int) -> None:
    world.kube.fail("apply", code, REFUSAL, kind="StatefulSet", name="llama-8b-decode")
    world.put_spec(document())
    outcome = world.reconcile()  # no RetryLaterError: a refusal does not go away by retrying with backoff

    assert "StatefulSet llama-8b-decode (missing)" not in outcome.applied
    assert len(outcome.applied) == children_count() - 1
    degraded = world.condition("Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ApplyFailed")
    assert REFUSAL in degraded["message"]
    assert world.condition("Progressing")["status"] == "True"  # the other children were just applied
    assert len(world.warnings("ApplyFailed")) == 1
    assert REFUSAL in world.warnings("ApplyFailed")[0]["message"]

    # The next passes try the refused object again (an event or resync may have fixed its cause) and post nothing
    # more; once the status has settled, that attempt is the only request a pass makes.
    assert PUBLISH_UIDS in verbs(world.pass_calls()[1])
    events = len(world.kube.events)
    world.reconcile()
    outcome, calls = world.pass_calls()
    assert verbs(calls) == [f"apply StatefulSet llama-8b-decode {code}"]
    assert len(world.kube.events) == events
    assert world.condition("Degraded")["reason"] == "ApplyFailed"
    assert world.condition("Progressing")["reason"] == "RollingOut"


def test_a_refusal_that_goes_away_recovers(world: World) -> None:
    refusal = world.kube.fail("apply", 422, REFUSAL, kind="StatefulSet", name="llama-8b-decode")
    world.put_spec(document())
    world.reconcile()
    world.kube.failures.remove(refusal)
    world.reconcile()
    world.watch(world.kube.finish_rollouts())
    world.reconcile()
    assert world.condition("Degraded")["reason"] == "AsExpected"
    assert [e["reason"] for e in world.kube.events if e["reason"] in ("ApplyFailed", "Recovered")] == [
        "ApplyFailed",
        "Recovered",
    ]


# ------------------------------------------------------------------------------- names held by other owners


def foreign_role(labelled: bool = False, owner: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Role `llama-8b-router` as another namespace user made it (`kubectl create role`), before the
    PDService existed: with pdserve's labels copied onto it (`labelled`: then the informer cache holds it too) or a
    controller reference of its own (`owner`)."""
    meta: dict[str, Any] = {
        "name": f"{NAME}-router",
        "namespace": NAMESPACE,
        "managedFields": [{"manager": "kubectl-create", "operation": "Update"}],
    }
    if labelled:
        meta["labels"] = {"app.kubernetes.io/instance": NAME, "app.kubernetes.io/managed-by": "pdserve-operator"}
    if owner is not None:
        meta["ownerReferences"] = [{**owner, "controller": True}]
    rules = [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}]
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta, "rules": rules}


@pytest.mark.parametrize("labelled", [False, True], ids=["unlabelled", "labelled-like-ours"])
def test_a_childs_name_held_by_another_owner_is_refused_and_nothing_is_written(world: World, labelled: bool) -> None:
    """Helm's rule: never take over what another owner created. The other user's Role keeps its rules and gets no
    controller reference of ours (so deleting the PDService can never garbage-collect it), and no other child is
    applied either (the router would run under a RoleBinding to a Role that is not ours)."""
    theirs = world.kube.add_object(foreign_role(labelled))
    if labelled:
        world.watch([theirs])
    world.put_spec(document())
    outcome, calls = world.pass_calls()
    assert verbs(calls, lambda call: call.verb in ("apply", "delete")) == []
    assert world.kube.objects[("Role", NAMESPACE, f"{NAME}-router")] == theirs
    degraded = world.condition("Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ChildConflict")
    assert (
        f"Role {NAME}-router exists and is not controlled by any owner, written by kubectl-create"
        in (degraded["message"])
    )
    assert (world.condition("Stalled")["status"], world.condition("Progressing")["reason"]) == ("True", "ChildConflict")
    assert [e["message"] for e in world.warnings("ChildConflict")] == [degraded["message"]]
    assert outcome.requeue_after == CONFLICT_RECHECK_S  # the Role may go without an event the operator sees

    # Passes while the Role stays write nothing more (no second Event).
    outcome, calls = world.pass_calls()
    assert calls == [] and outcome.result == "noop"

    # Its owner deletes it: the next pass creates every child and the PDService recovers.
    del world.kube.objects[("Role", NAMESPACE, f"{NAME}-router")]
    if labelled:
        world.store.delete(theirs)
    outcome = world.reconcile()
    assert len(outcome.applied) == children_count()
    assert world.condition("Degraded")["reason"] == "AsExpected"
    assert world.kube.events[-1]["reason"] == "Recovered"


def test_an_object_handed_over_with_this_pdservices_controller_reference_is_adopted(world: World) -> None:
    world.put_spec(document())
    uid = world.kube.owner(NAMESPACE, NAME)["metadata"]["uid"]
    ours = {"apiVersion": "pdserve.io/v1alpha1", "kind": "PDService", "name": NAME, "uid": uid}
    world.kube.add_object(foreign_role(owner=ours))
    outcome = world.reconcile()
    assert f"Role {NAME}-router (changed)" in outcome.applied  # read, found ours, brought to the render
    assert world.kube.objects[("Role", NAMESPACE, f"{NAME}-router")]["rules"] != foreign_role()["rules"]
    assert world.condition("Degraded")["reason"] != "ChildConflict"


def test_a_name_held_by_a_deleted_predecessor_is_waited_for_not_reported(world: World) -> None:
    """`kubectl delete pds` then `kubectl apply` at once: the old children (controlled by the old UID) are still
    there until the garbage collector deletes them; the new PDService waits, retrying with backoff, and reports no
    conflict (the collector deletes them by itself)."""
    world.put_spec(document())
    old = {"apiVersion": "pdserve.io/v1alpha1", "kind": "PDService", "name": NAME, "uid": "deleted-uid"}
    world.kube.add_object(foreign_role(owner=old))
    with pytest.raises(RetryLaterError, match=f"waiting for the garbage collector to delete Role {NAME}-router"):
        world.reconcile()
    assert not [call for call in world.kube.calls if call.verb in ("apply", "delete")]
    assert world.condition("Degraded")["status"] == "False"


def test_a_name_that_cannot_be_read_writes_nothing_and_retries(world: World) -> None:
    world.kube.fail("read", 503, "etcd leader changed", kind="Role", times=1)
    world.put_spec(document())
    with pytest.raises(RetryLaterError, match=f"read Role {NAME}-router"):
        world.reconcile()
    assert not [call for call in world.kube.calls if call.verb in ("apply", "delete")]
    assert len(world.reconcile().applied) == children_count()


def test_only_names_the_cache_lacks_are_read(world: World) -> None:
    world.put_spec(document())
    world.reconcile()
    assert len(world.kube.reads) == children_count()  # creation: every name looked up once
    world.watch(world.kube.finish_rollouts())
    world.reconcile()
    assert len(world.kube.reads) == children_count()  # every child cached (its apply answer): no read


def test_a_foreign_pod_is_ignored_by_status_and_reported_once(world: World) -> None:
    """An `edit` user's pod with the pool's labels (unschedulable: it asks for GPUs no node has) never holds the
    PDService at PodsPending; it gets one Warning Event, not one per pass."""
    world.converge()
    reported = ForeignPods()
    labels = {"app.kubernetes.io/instance": NAME, "app.kubernetes.io/managed-by": "pdserve-operator"}
    intruder: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "intruder",
            "namespace": NAMESPACE,
            "uid": "u-intruder",
            "labels": {**labels, "pdserve.io/role": "prefill"},
        },
        "status": {
            "phase": "Pending",
            "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/9 nodes"}
            ],
        },
    }
    world.watch([intruder])

    def run() -> Outcome:
        return reconcile(
            NAMESPACE,
            NAME,
            world.store,
            world.kube,
            world.now,
            views=world.views,
            crash_window=OperatorSettings.crash_recovery_seconds,
            applier=world.applier,
            reported=reported,
        )

    outcome = run()
    assert world.condition("Degraded")["reason"] == "AsExpected"  # not PodsPending
    warnings = world.warnings("ForeignPodIgnored")
    assert len(warnings) == 1 and warnings[0]["message"].startswith("Ignored pod intruder (pdserve.io/role=prefill)")
    assert outcome.events == [f"Warning ForeignPodIgnored: {warnings[0]['message']}"]
    assert run().events == [] and len(world.warnings("ForeignPodIgnored")) == 1
    # Gone and back (a new pod of that name): reported again.
    world.store.delete(intruder)
    run()
    world.watch([{**intruder, "metadata": {**intruder["metadata"], "uid": "u-intruder-2"}}])
    run()
    assert len(world.warnings("ForeignPodIgnored")) == 2


# ------------------------------------------------------------------------------------------------ transient


@pytest.mark.parametrize("code", [0, 409, 429, 500, 503], ids=["connection", "409", "429", "500", "503"])
def test_a_transient_apply_error_writes_status_then_retries(world: World, code: int) -> None:
    world.kube.fail("apply", code, kind="StatefulSet", name="llama-8b-decode", times=1)
    world.put_spec(document())
    mark = world.kube.mark()
    with pytest.raises(RetryLaterError, match="StatefulSet llama-8b-decode"):
        world.reconcile()
    calls = world.kube.calls_since(mark)
    failed = calls.index(Call("apply", "StatefulSet", "llama-8b-decode", str(code)))
    status = [i for i, call in enumerate(calls) if call.verb == "status"]
    assert status and status[-1] > failed and calls[status[-1]].written
    # Transient trouble is not a refusal: no ApplyFailed condition or event.
    assert world.condition("Degraded")["reason"] != "ApplyFailed"
    assert not world.warnings("ApplyFailed")

    # The work queue's retry: the missing object is applied and the pass ends normally.
    outcome, calls = world.pass_calls()
    assert "StatefulSet llama-8b-decode (missing)" in outcome.applied
    assert verbs(calls, lambda call: call.verb == "apply") == [PUBLISH_UIDS, "apply StatefulSet llama-8b-decode ok"]


@pytest.mark.parametrize("code", [0, 500, 409])
def test_a_transient_status_error_retries(world: World, code: int) -> None:
    world.kube.fail("status", code, times=1)
    world.put_spec(document())
    with pytest.raises(RetryLaterError, match="status"):
        world.reconcile()
    # Children were applied; the retry only needs to write the status (and the Services' UIDs, now known).
    _, calls = world.pass_calls()
    assert verbs(calls, lambda call: call.verb != "event") == [PUBLISH_UIDS, f"status PDService {NAME} ok"]


def test_a_transient_prune_error_writes_status_then_retries(world: World) -> None:
    world.converge()
    # A child an older render produced, still controlled by this PDService.
    uid = world.kube.owner(NAMESPACE, NAME)["metadata"]["uid"]
    leftover = world.kube.apply(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": "llama-8b-leftover",
                "namespace": NAMESPACE,
                "labels": {"app.kubernetes.io/instance": NAME},
                "ownerReferences": [{"kind": "PDService", "name": NAME, "uid": uid, "controller": True}],
            },
        }
    )
    world.watch([leftover])
    world.kube.fail("delete", 503, kind="ConfigMap", times=1)
    mark = world.kube.mark()
    with pytest.raises(RetryLaterError, match="delete ConfigMap llama-8b-leftover"):
        world.reconcile()
    assert verbs(world.kube.calls_since(mark)) == ["delete ConfigMap llama-8b-leftover 503"]  # status unchanged
    outcome = world.reconcile()
    assert outcome.pruned == ["ConfigMap llama-8b-leftover"]
    assert ("ConfigMap", NAMESPACE, "llama-8b-leftover") not in world.kube.objects


# ------------------------------------------------------------------------------------------ leadership lost


def test_leadership_lost_mid_wave_stops_every_write(world: World) -> None:
    world.put_spec(document())
    world.kube.lose_leadership_after(2)
    mark = world.kube.mark()
    with pytest.raises(NotLeaderError):
        world.reconcile()
    calls = world.kube.calls_since(mark)
    assert verbs(calls, lambda call: call.written) == verbs(calls[:2])
    first_refused = next(i for i, call in enumerate(calls) if not call.written)
    after = calls[first_refused:]
    # Only objects of the same wave, already handed to the pool, may still try (and be refused); nothing of the
    # next wave, no prune, no status, no event.
    assert all(call.outcome == "not-leader" for call in after), verbs(after)
    assert all(call.verb == "apply" and call.kind not in WORKLOAD_KINDS for call in after), verbs(after)
    assert world.kube.events == []
    assert "status" not in (world.kube.owner(NAMESPACE, NAME))


def test_leadership_lost_before_the_status_write_stops_it(world: World) -> None:
    world.put_spec(document())
    world.kube.lose_leadership_after(children_count())  # every apply succeeds; the events and status do not
    with pytest.raises(NotLeaderError):
        world.reconcile()
    refused = [call for call in world.kube.calls if not call.written]
    assert refused and all(call.verb in ("event", "status") for call in refused)
    assert world.kube.events == []
    assert "status" not in world.kube.owner(NAMESPACE, NAME)


# -------------------------------------------------------------------------------------------- invalid spec


def test_an_invalid_spec_is_reported_once_and_children_are_left_alone(world: World) -> None:
    world.converge()
    world.put_spec(invalid(document()))
    outcome, calls = world.pass_calls()
    assert outcome.result == "invalid"
    assert verbs(calls) == [f"status PDService {NAME} ok", f"event Event {NAME} ok"]
    degraded = world.condition("Degraded")
    assert (degraded["status"], degraded["reason"], degraded["observedGeneration"]) == ("True", "InvalidSpec", 2)
    assert "spec.prefill.gpusPerPod" in degraded["message"]
    assert world.condition("Progressing")["reason"] == "InvalidSpec"
    assert len(world.warnings("InvalidSpec")) == 1
    # No retry storm: nothing changes until the user edits the spec, so the next passes write nothing.
    for _ in range(2):
        outcome, calls = world.pass_calls()
        assert (outcome.result, calls) == ("invalid", [])


def test_an_invalid_new_pdservice_creates_nothing(world: World) -> None:
    world.put_spec(invalid(document()))
    outcome, calls = world.pass_calls()
    assert outcome.result == "invalid"
    assert not [call for call in calls if call.verb in ("apply", "delete")]
    assert world.condition("Degraded")["reason"] == "InvalidSpec"
    assert len(world.warnings("InvalidSpec")) == 1


# ---------------------------------------------------------------------------------------------- crashed engine


def engine_pod(phase: str, *, ready_at: str = "") -> dict[str, Any]:
    """llama-8b-decode-0 as its watch events show it after its engine exited with code 70 at 09:00:00: being
    restarted (`restarting`), or running and ready since `ready_at` (`ready`)."""
    ready = phase == "ready"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "llama-8b-decode-0",
            "namespace": NAMESPACE,
            "labels": {"app.kubernetes.io/instance": NAME, "pdserve.io/role": "decode"},
        },
        "status": {
            "phase": "Running",
            "conditions": [
                {"type": "Ready", "status": str(ready), "lastTransitionTime": ready_at or "2026-01-01T09:00:00Z"}
            ],
            "containerStatuses": [
                {
                    "name": "vllm",
                    "restartCount": 1,
                    "ready": ready,
                    "state": {"running": {"startedAt": "2026-01-01T09:00:01Z"}}
                    if ready
                    else {"waiting": {"reason": "ContainerCreating"}},
                    "lastState": {
                        "terminated": {"exitCode": 70, "reason": "Error", "finishedAt": "2026-01-01T09:00:00Z"}
                    },
                }
            ],
        },
    }


def test_a_crashed_engine_is_reported_once_and_recovers_after_the_window(world: World) -> None:
    """The pass that sees a crashed engine says so (Degraded/EngineCrashed, one Warning event); the passes of its
    restart write nothing; a pass asks to be re-run when the recovery window ends, and that pass recovers."""
    world.converge()
    window = 30.0

    def run_at(clock: str) -> tuple[Outcome, list[Call]]:
        mark = world.kube.mark()
        outcome = reconcile(
            NAMESPACE,
            NAME,
            world.store,
            world.kube,
            lambda: clock,
            views=world.views,
            crash_window=window,
            applier=world.applier,
        )
        return outcome, world.kube.calls_since(mark)

    world.watch([world.pool_pod(engine_pod("restarting"))])
    outcome, calls = run_at("2026-01-01T09:00:01Z")
    assert verbs(calls) == [f"status PDService {NAME} ok", f"event Event {NAME} ok"]
    assert outcome.requeue_after is None  # not ready yet: its readiness will come as a pod event
    degraded = world.condition("Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "EngineCrashed")
    assert "llama-8b-decode-0/vllm: exited with code 70 (Error)" in degraded["message"]
    assert [e["message"] for e in world.warnings("EngineCrashed")] == [degraded["message"]]

    # Ready again at 09:00:10: nothing to write, but the pass must run again once the window is over (09:00:40).
    world.watch([world.pool_pod(engine_pod("ready", ready_at="2026-01-01T09:00:10Z"))])
    outcome, calls = run_at("2026-01-01T09:00:12Z")
    assert calls == []
    assert outcome.requeue_after == 29.0
    outcome, calls = run_at("2026-01-01T09:00:40Z")
    assert verbs(calls) == [f"status PDService {NAME} ok", f"event Event {NAME} ok"]
    assert outcome.requeue_after is None
    assert world.condition("Degraded")["status"] == "False"
    assert world.kube.events[-1]["reason"] == "Recovered"
    assert len(world.warnings("EngineCrashed")) == 1


# ---------------------------------------------------------------------------------- the pure steps on their own


def stored(doc: dict[str, Any] | None = None, status: dict[str, Any] | None = None) -> dict[str, Any]:
    body = doc or document()
    body["metadata"].update(uid="u1", resourceVersion="7", generation=1)
    if status is not None:
        body["status"] = status
    return body


def test_plan_writes_creates_everything_then_nothing() -> None:
    body = stored()
    checked = validate(spec_document(body))
    first = plan_writes(checked, Snapshot(), NOTHING_OBSERVED, "u1")
    assert [a.obj["kind"] for a in first.applies] == [o["kind"] for o in render(checked)]
    assert {a.reason for a in first.applies} == {"missing"} and first.prunes == []
    # The children exist as applied: nothing to write.
    children = {key_of(a.obj): {**a.obj, "metadata": {**a.obj["metadata"], "uid": "c"}} for a in first.applies}
    assert plan_writes(checked, Snapshot(children=children), NOTHING_OBSERVED, "u1").empty


def statefulset(role: str, replicas: int) -> dict[str, Any]:
    return {
        "kind": "StatefulSet",
        "metadata": {"name": f"{NAME}-{role}", "namespace": NAMESPACE},
        "spec": {"replicas": replicas},
    }


def test_status_intent_of_a_valid_spec_is_what_it_asks_and_serves() -> None:
    doc = document()
    doc["spec"]["prefill"]["autoscaling"] = {"enabled": True, "minReplicas": 1, "maxReplicas": 4}
    body = stored(doc)
    checked = validate(spec_document(body))
    snapshot = Snapshot(children={key_of(s): s for s in (statefulset("prefill", 3), statefulset("decode", 4))})
    intent = status_intent(body, checked, snapshot, report=None, configured=False)
    # The autoscaled pool's StatefulSet decides its replicas; the other pool's are the spec's.
    assert intent.desired == {"prefill": None, "decode": 4}
    assert intent.router_endpoint == f"http://{NAME}-router.{NAMESPACE}.svc:8080"
    assert intent.kv_compat_hash == kv_compat_hash(checked.require()[1])
    assert intent.fallback_to_decode is checked.require()[1].router.routing.fallback_to_decode
    # Without a Prometheus, the autoscaler's view says so, with the StatefulSet's replicas.
    assert intent.autoscaling["prefill"]["reason"] == "PrometheusNotConfigured"
    assert intent.autoscaling["prefill"]["currentReplicas"] == 3
    assert [c.type for c in intent.scaling_conditions] == ["ScalingActive", "AbleToScale", "ScalingLimited"]


def test_status_intent_of_an_invalid_spec_keeps_what_the_status_said() -> None:
    old = {
        "routerEndpoint": "http://old",
        "prefill": {"autoscaling": {"mode": "pdserve", "reason": "ScaledUp"}},
        "conditions": [
            {"type": "ScalingActive", "status": "True", "reason": "ValidMetricFound", "message": "fresh"},
            {"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable", "message": ""},
        ],
    }
    body = stored(invalid(document()), status=old)
    checked = validate(spec_document(body))
    assert not checked.ok
    intent = status_intent(body, checked, Snapshot(), report=None, configured=True)
    # It parsed: the pools still say what the (invalid) spec asks; what the children serve is left to the status.
    assert intent.desired == {"prefill": 2, "decode": 4}
    assert (intent.router_endpoint, intent.kv_compat_hash) == (None, None)
    assert intent.autoscaling == {"prefill": {"mode": "pdserve", "reason": "ScaledUp"}}
    assert [(c.type, c.reason) for c in intent.scaling_conditions] == [("ScalingActive", "ValidMetricFound")]
    # A document that does not parse asks nothing: every pool's StatefulSet decides.
    unparsed = validate({"apiVersion": "pdserve.io/v1alpha1", "kind": "PDService", "metadata": {"name": NAME}})
    assert status_intent(body, unparsed, Snapshot(), report=None, configured=True).desired == {
        "prefill": None,
        "decode": None,
    }


def condition(type_: str, status: str, reason: str, message: str = "m") -> dict[str, str]:
    return {"type": type_, "status": status, "reason": reason, "message": message}


@pytest.mark.parametrize(
    ("old", "new", "events"),
    [
        ([], [condition("Available", "True", "MinimumReplicasAvailable")], [("Normal", "Available", "m")]),
        ([], [condition("Available", "False", "DecodeUnavailable")], []),  # never available: no news
        (
            [condition("Available", "True", "MinimumReplicasAvailable")],
            [condition("Available", "False", "DecodeUnavailable", "no decode engine is ready")],
            [("Warning", "Unavailable", "no decode engine is ready")],
        ),
        (
            [],
            [condition("Degraded", "True", "PodsPending", "p-0: no GPU")],
            [("Warning", "PodsPending", "p-0: no GPU")],
        ),
        ([condition("Degraded", "True", "PodsPending")], [condition("Degraded", "True", "PodsPending")], []),
        (
            [condition("Degraded", "True", "PodsPending")],
            [condition("Degraded", "False", "AsExpected")],
            [("Normal", "Recovered", "no longer degraded (was PodsPending)")],
        ),
        (
            [condition("ScalingActive", "True", "ValidMetricFound")],
            [condition("ScalingActive", "False", "MetricsUnavailable", "down")],
            [("Warning", "MetricsUnavailable", "autoscaling holds: down")],
        ),
        (
            [condition("ScalingActive", "False", "MetricsUnavailable")],
            [condition("ScalingActive", "True", "ValidMetricFound")],
            [("Normal", "ScalingActive", "autoscaling resumed (was MetricsUnavailable)")],
        ),
    ],
)
def test_transition_events_say_what_a_user_cares_about(
    old: list[dict[str, str]], new: list[dict[str, str]], events: list[tuple[str, str, str]]
) -> None:
    assert transition_events({"conditions": old}, {"conditions": new}) == events
