"""Status from observed children: conditions, reasons, messages, transition times."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.api.defaults import effective
from pdserve.api.kvcompat import kv_compat_hash
from pdserve.api.settings import OperatorSettings
from pdserve.api.v1alpha1 import PDService
from pdserve.api.validation import Problem, Validated
from pdserve_dev.cluster import tools
from pdserve_operator import status as st
from pdserve_operator.observed import Snapshot
from pdserve_operator.reconcile import status_intent

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pdservice.yaml"
T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def body(status: dict[str, Any] | None = None, generation: int = 3) -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    document["metadata"].update(uid="u1", generation=generation)
    if status is not None:
        document["status"] = status
    return document


def pds() -> PDService:
    return PDService.model_validate({k: v for k, v in body().items() if k != "status"})


CRASH_WINDOW = OperatorSettings.crash_recovery_seconds


def compute(
    stored: dict[str, Any],
    snap: Snapshot,
    *,
    now: str,
    problems: list[Problem] | None = None,
    apply_errors: list[str] | None = None,
    conflicts: list[str] | None = None,
    crash_window: float = CRASH_WINDOW,
) -> dict[str, Any]:
    """The status the reconcile computes for the example PDService (its spec valid unless `problems`) over `snap`:
    what its spec asks as values (`status_intent`), the facts of the pass, the status."""
    model = pds()
    checked = Validated(model, effective(model.spec), tuple(problems or ()))
    intent = status_intent(stored, checked, snap, report=None, configured=False)
    facts = st.facts_of(stored, snap, intent, now, crash_window)
    return st.compute_status(
        stored,
        facts,
        intent,
        problems=checked.problems,
        apply_errors=apply_errors or [],
        conflicts=conflicts or [],
        now=now,
    )


def next_check(snap: Snapshot, now: str, crash_window: float = CRASH_WINDOW) -> float | None:
    """Seconds until the status of the example PDService over `snap` changes by itself (`next_check_seconds`)."""
    model = pds()
    intent = status_intent(body(), Validated(model, effective(model.spec), ()), snap, report=None, configured=False)
    return st.next_check_seconds(st.facts_of(body(), snap, intent, now, crash_window), now)


def sts(
    role: str, replicas: int, ready: int, *, updated: int | None = None, revisions: tuple[str, str] = ("r1", "r1")
) -> dict[str, Any]:
    return {
        "kind": "StatefulSet",
        "metadata": {"name": f"llama-8b-{role}", "namespace": "default", "generation": 2},
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": 2,
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": replicas if updated is None else updated,
            "currentRevision": revisions[0],
            "updateRevision": revisions[1],
        },
    }


def router(ready: int, replicas: int = 2, conditions: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "kind": "Deployment",
        "metadata": {"name": "llama-8b-router", "namespace": "default", "generation": 1},
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": 1,
            "replicas": replicas,
            "updatedReplicas": replicas,
            "readyReplicas": ready,
            "availableReplicas": ready,
            "conditions": conditions or [],
        },
    }


def slice_(ready: bool = True) -> dict[str, Any]:
    return {"kind": "EndpointSlice", "endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": ready}}]}


def snapshot(
    *children: dict[str, Any], pods: list[dict[str, Any]] | None = None, slices: list[dict[str, Any]] | None = None
) -> Snapshot:
    return Snapshot(
        children={(c["kind"], "default", c["metadata"]["name"]): c for c in children},
        pods=pods or [],
        endpoint_slices=slices if slices is not None else [slice_()],
    )


def healthy() -> Snapshot:
    return snapshot(sts("prefill", 2, 2), sts("decode", 4, 4), router(2))


def pending_pod(name: str, message: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "status": {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}],
        },
    }


def crashing_pod(name: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "status": {
            "phase": "Running",
            "containerStatuses": [
                {"name": "vllm", "restartCount": 5, "state": {"waiting": {"reason": "CrashLoopBackOff"}}}
            ],
        },
    }


def pulling_pod(name: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "status": {
            "phase": "Pending",
            "containerStatuses": [
                {"name": "vllm", "restartCount": 0, "state": {"waiting": {"reason": "ImagePullBackOff"}}}
            ],
        },
    }


CRASHED_AT, RESTARTED_AT, READY_AT = "2025-12-31T23:59:50Z", "2025-12-31T23:59:51Z", "2025-12-31T23:59:55Z"


def crashed_pod(
    name: str,
    phase: str,
    *,
    role: str = "decode",
    restarts: int = 1,
    exit_code: int = 70,
    reason: str = "Error",
    ready_at: str = READY_AT,
) -> dict[str, Any]:
    """A pod whose container exited at CRASHED_AT and was restarted, seen at one `phase` of its restart:
    `waiting` (being restarted), `backoff` (CrashLoopBackOff), `starting` (running, not ready yet), `ready`
    (running and ready since `ready_at`)."""
    state: dict[str, Any] = {
        "waiting": {"waiting": {"reason": "ContainerCreating"}},
        "backoff": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s restarting failed container"}},
        "starting": {"running": {"startedAt": RESTARTED_AT}},
        "ready": {"running": {"startedAt": RESTARTED_AT}},
    }[phase]
    ready = phase == "ready"
    return {
        "metadata": {"name": name, "labels": {"pdserve.io/role": role}},
        "status": {
            "phase": "Running",
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True" if ready else "False",
                    "lastTransitionTime": ready_at if ready else T0,
                }
            ],
            "containerStatuses": [
                {
                    "name": "vllm",
                    "restartCount": restarts,
                    "ready": ready,
                    "state": state,
                    "lastState": {
                        "terminated": {
                            "exitCode": exit_code,
                            "reason": reason,
                            "startedAt": "2025-12-31T23:00:00Z",
                            "finishedAt": CRASHED_AT,
                        }
                    },
                }
            ],
        },
    }


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


# (observed children, expected conditions): the table every rule is checked against, here and by kstatus below.
CASES: list[tuple[Snapshot, dict[str, tuple[str, str]]]] = [
    (
        healthy(),
        {
            "Available": ("True", "MinimumReplicasAvailable"),
            "Progressing": ("False", "Complete"),
            "Degraded": ("False", "AsExpected"),
            "Ready": ("True", "AllReady"),
            "Reconciling": ("False", "Complete"),
            "Stalled": ("False", "AsExpected"),
        },
    ),
    (
        snapshot(),
        {
            "Available": ("False", "DecodeUnavailable"),
            "Progressing": ("True", "RollingOut"),
            "Degraded": ("False", "AsExpected"),
            "Ready": ("False", "RollingOut"),
            "Reconciling": ("True", "RollingOut"),
            "Stalled": ("False", "AsExpected"),
        },
    ),
    (
        snapshot(sts("prefill", 2, 0), sts("decode", 4, 4), router(2)),
        {
            "Available": ("False", "PrefillUnavailable"),
            "Progressing": ("True", "RollingOut"),
            "Degraded": ("False", "AsExpected"),
            "Ready": ("False", "RollingOut"),
            "Reconciling": ("True", "RollingOut"),
            "Stalled": ("False", "AsExpected"),
        },
    ),
    (
        snapshot(sts("prefill", 2, 2), sts("decode", 4, 4), router(2), slices=[slice_(ready=False)]),
        {
            "Available": ("False", "RouterUnavailable"),
            "Progressing": ("False", "Complete"),
            "Degraded": ("False", "AsExpected"),
            "Ready": ("False", "RouterUnavailable"),
            "Reconciling": ("True", "RouterUnavailable"),
            "Stalled": ("False", "AsExpected"),
        },
    ),
    (
        snapshot(sts("prefill", 2, 1, updated=1, revisions=("r1", "r2")), sts("decode", 4, 4), router(2)),
        {
            "Available": ("True", "MinimumReplicasAvailable"),
            "Progressing": ("True", "RollingOut"),
            "Degraded": ("False", "AsExpected"),
            "Ready": ("False", "RollingOut"),
            "Reconciling": ("True", "RollingOut"),
            "Stalled": ("False", "AsExpected"),
        },
    ),
    (
        snapshot(
            sts("prefill", 2, 0),
            sts("decode", 4, 4),
            router(2),
            pods=[pending_pod("llama-8b-prefill-0", "0/16 nodes are available: 16 Insufficient nvidia.com/gpu.")],
        ),
        {
            "Available": ("False", "PrefillUnavailable"),
            "Progressing": ("True", "RollingOut"),
            "Degraded": ("True", "PodsPending"),
            "Ready": ("False", "PodsPending"),
            "Reconciling": ("True", "PodsPending"),
            "Stalled": ("False", "AsExpected"),
        },
    ),
    (
        snapshot(sts("prefill", 2, 2), sts("decode", 4, 3), router(2), pods=[crashing_pod("llama-8b-decode-3")]),
        {
            "Available": ("True", "MinimumReplicasAvailable"),
            "Progressing": ("True", "RollingOut"),
            "Degraded": ("True", "CrashLooping"),
            "Ready": ("False", "CrashLooping"),
            "Reconciling": ("False", "Stalled"),
            "Stalled": ("True", "CrashLooping"),
        },
    ),
    (
        snapshot(
            sts("prefill", 2, 2),
            sts("decode", 4, 4),
            router(0, conditions=[{"type": "Progressing", "status": "False", "message": "deadline exceeded"}]),
        ),
        {
            "Available": ("False", "RouterUnavailable"),
            "Progressing": ("True", "RollingOut"),
            "Degraded": ("True", "RouterUnavailable"),
            "Ready": ("False", "RouterUnavailable"),
            "Reconciling": ("False", "Stalled"),
            "Stalled": ("True", "RouterUnavailable"),
        },
    ),
    (
        snapshot(
            sts("prefill", 2, 2), sts("decode", 4, 3), router(2), pods=[crashed_pod("llama-8b-decode-3", "starting")]
        ),
        {
            "Available": ("True", "MinimumReplicasAvailable"),
            "Progressing": ("True", "RollingOut"),
            "Degraded": ("True", "EngineCrashed"),
            "Ready": ("False", "EngineCrashed"),
            "Reconciling": ("True", "EngineCrashed"),
            "Stalled": ("False", "AsExpected"),
        },
    ),
    (
        snapshot(
            sts("prefill", 2, 2),
            sts("decode", 4, 4),
            router(2),
            pods=[crashed_pod("llama-8b-router-x", "ready", role="router")],
        ),
        {
            "Available": ("True", "MinimumReplicasAvailable"),
            "Progressing": ("False", "Complete"),
            "Degraded": ("True", "RouterCrashed"),
            "Ready": ("False", "RouterCrashed"),
            "Reconciling": ("True", "RouterCrashed"),
            "Stalled": ("False", "AsExpected"),
        },
    ),
    (
        snapshot(sts("prefill", 2, 2), sts("decode", 4, 3), router(2), pods=[pulling_pod("llama-8b-decode-3")]),
        {
            "Available": ("True", "MinimumReplicasAvailable"),
            "Progressing": ("True", "RollingOut"),
            "Degraded": ("True", "ImagePullFailed"),
            "Ready": ("False", "ImagePullFailed"),
            "Reconciling": ("True", "ImagePullFailed"),
            "Stalled": ("False", "AsExpected"),
        },
    ),
]


@pytest.mark.parametrize(("snap", "expected"), CASES)
def test_conditions(snap: Snapshot, expected: dict[str, tuple[str, str]]) -> None:
    status = compute(body(), snap, now=T0)
    assert conditions(status) == expected
    assert status["observedGeneration"] == 3
    assert all(c["observedGeneration"] == 3 for c in status["conditions"])
    # kstatus: exactly one verdict, Current (Ready), InProgress (Reconciling) or Failed (Stalled).
    gitops = {c["type"]: c for c in status["conditions"] if c["type"] in ("Ready", "Reconciling", "Stalled")}
    assert len([t for t, c in gitops.items() if c["status"] == "True"]) == 1
    # A condition that is not Ready says why, with the cause's message.
    if gitops["Ready"]["status"] == "False":
        assert gitops["Ready"]["message"]


def test_pods_pending_carries_the_scheduler_message() -> None:
    message = "0/16 nodes are available: 16 Insufficient nvidia.com/gpu. preemption: 0/16 nodes are available."
    snap = snapshot(sts("prefill", 2, 0), sts("decode", 4, 4), router(2), pods=[pending_pod("p-0", message)])
    degraded = next(c for c in compute(body(), snap, now=T0)["conditions"] if c["type"] == "Degraded")
    assert degraded["message"] == f"p-0: {message}"


def degraded_of(status: dict[str, Any]) -> dict[str, Any]:
    return dict(next(c for c in status["conditions"] if c["type"] == "Degraded"))


def test_a_single_crash_is_reported_with_what_a_human_needs() -> None:
    """Item 8 of issue 13: one crash is Degraded at once, without waiting for CrashLoopBackOff, naming the pod, the
    container, the exit code, the termination reason and time, and the restart count."""
    pod = crashed_pod("llama-8b-decode-1", "waiting", exit_code=137, reason="OOMKilled")
    pod["status"]["containerStatuses"][0]["lastState"]["terminated"]["message"] = "CUDA out of memory.\n  at step 7"
    status = compute(body(), snapshot(sts("prefill", 2, 2), sts("decode", 4, 3), router(2), pods=[pod]), now=T0)
    assert degraded_of(status)["reason"] == "EngineCrashed"
    assert degraded_of(status)["message"] == (
        f"llama-8b-decode-1/vllm: exited with code 137 (OOMKilled) at {CRASHED_AT}, 1 restart: "
        "CUDA out of memory. at step 7"
    )


def test_a_crash_keeps_one_status_through_its_restart_until_the_window_ends() -> None:
    """From the crash to the end of the recovery window the status is one and the same (no write, no new Event,
    no flapping), whatever phase of its restart the container is in; then it recovers."""
    healthy_pools = (sts("prefill", 2, 2), sts("decode", 4, 4), router(2))
    first = compute(body(), snapshot(*healthy_pools, pods=[crashed_pod("d-0", "waiting")]), now=T0)
    assert conditions(first)["Degraded"] == ("True", "EngineCrashed")
    current = first
    for phase in ("starting", "ready"):
        snap = snapshot(*healthy_pools, pods=[crashed_pod("d-0", phase)])
        again = compute(body(current), snap, now=T0)
        assert st.status_patch(current, again) is None, phase
        current = again
    # Ready since READY_AT (5 s before T0): the window (60 s) ends at 00:00:55; the reconcile asks to run again just
    # after it (timestamps have one-second resolution), since no event will come.
    ready = snapshot(*healthy_pools, pods=[crashed_pod("d-0", "ready")])
    assert next_check(ready, T0) == 56
    assert next_check(ready, T0, crash_window=10) == 6
    assert next_check(snapshot(*healthy_pools, pods=[crashed_pod("d-0", "starting")]), T0) is None
    assert next_check(healthy(), T0) is None
    # One second before the end: still crashed. At the end: recovered, and nothing left to wait for.
    assert conditions(compute(body(current), ready, now="2026-01-01T00:00:54Z"))["Degraded"] == (
        "True",
        "EngineCrashed",
    )
    recovered = compute(body(current), ready, now="2026-01-01T00:00:55Z")
    assert conditions(recovered)["Degraded"] == ("False", "AsExpected")
    assert conditions(recovered)["Ready"] == ("True", "AllReady")
    assert next_check(ready, "2026-01-01T00:00:55Z") is None
    # The window is the operator's --crash-recovery-seconds.
    short = compute(body(current), ready, now=T0, crash_window=5)
    assert conditions(short)["Degraded"] == ("False", "AsExpected")


def test_the_window_counts_from_the_later_of_the_start_and_the_ready_transition() -> None:
    # Ready long ago by the pod condition, but the container (re)started 5 s ago: 5 s, not an hour.
    pod = crashed_pod("d-0", "ready", ready_at="2025-12-31T20:00:00Z")
    pod["status"]["containerStatuses"][0]["state"]["running"]["startedAt"] = READY_AT
    assert next_check(snapshot(pods=[pod]), T0) == 56
    # No timestamps at all on a running, ready container: nothing could ever clear it, so it counts as recovered.
    del pod["status"]["containerStatuses"][0]["state"]["running"]["startedAt"]
    del pod["status"]["conditions"][0]["lastTransitionTime"]
    assert st.container_crashes([pod], st.parse_time(T0) or pytest.fail("T0"), 60) == []


def test_an_old_crash_is_not_blamed_for_a_later_unreadiness() -> None:
    """Restarted yesterday, ran fine, unready now (overloaded, a failing dependency): that is not a crash, and the
    message must not report yesterday's exit as news. Unready within the window after the restart, it is."""
    pod = crashed_pod("d-0", "starting")
    pod["status"]["conditions"][0]["lastTransitionTime"] = T0  # turned unready at T0, long after its start
    pod["status"]["containerStatuses"][0]["state"]["running"]["startedAt"] = "2025-12-31T00:00:00Z"
    assert st.container_crashes([pod], st.parse_time(T1) or pytest.fail("T1"), 60) == []
    pod["status"]["containerStatuses"][0]["state"]["running"]["startedAt"] = "2025-12-31T23:59:30Z"  # 30 s before
    assert [c.pod for c in st.container_crashes([pod], st.parse_time(T1) or pytest.fail("T1"), 60)] == ["d-0"]


def test_a_crash_loop_is_stalled_for_its_whole_length() -> None:
    """A container that crashes again is CrashLooping (Stalled) from its first back-off until it has been ready for
    the window, also while the kubelet's next restart runs it: the verdict does not flip every back-off."""
    pools = (sts("prefill", 2, 2), sts("decode", 4, 3), router(2))
    first = compute(body(), snapshot(*pools, pods=[crashed_pod("d-0", "starting")]), now=T0)
    assert conditions(first)["Stalled"] == ("False", "AsExpected")
    loop = compute(body(first), snapshot(*pools, pods=[crashed_pod("d-0", "backoff", restarts=2)]), now=T1)
    assert conditions(loop)["Degraded"] == ("True", "CrashLooping")
    assert conditions(loop)["Stalled"] == ("True", "CrashLooping")
    assert degraded_of(loop)["message"] == f"d-0/vllm: exited with code 70 (Error) at {CRASHED_AT}, 2 restarts"
    just_ready = "2026-01-01T00:04:58Z"
    for phase in ("starting", "ready"):
        pod = crashed_pod("d-0", phase, restarts=2, ready_at=just_ready)
        again = compute(body(loop), snapshot(*pools, pods=[pod]), now=T1)
        assert st.status_patch(loop, again) is None, phase
    # Ready for the window: recovered, and Stalled with it.
    later = "2026-01-01T00:10:00Z"
    done = compute(
        body(loop),
        snapshot(*pools, pods=[crashed_pod("d-0", "ready", restarts=2, ready_at=just_ready)]),
        now=later,
    )
    assert conditions(done)["Degraded"] == ("False", "AsExpected")
    assert conditions(done)["Stalled"] == ("False", "AsExpected")
    # A second, unrelated crash later starts as a single crash again, not as the old loop.
    fresh = compute(body(done), snapshot(*pools, pods=[crashed_pod("d-1", "starting")]), now=later)
    assert conditions(fresh)["Degraded"] == ("True", "EngineCrashed")


def test_engine_crashes_outrank_router_crashes() -> None:
    pods = [crashed_pod("r-0", "starting", role="router"), crashed_pod("d-0", "starting")]
    status = compute(body(), snapshot(*healthy().children.values(), pods=pods), now=T0)
    assert degraded_of(status)["reason"] == "EngineCrashed"
    assert degraded_of(status)["message"].startswith("d-0/vllm: exited with code 70")
    assert "; r-0/vllm: exited with code 70" in degraded_of(status)["message"]


def test_pool_status_router_endpoint_and_hash() -> None:
    status = compute(body(), healthy(), now=T0)
    assert status["prefill"] == {"replicas": 2, "readyReplicas": 2, "desiredReplicas": 2}
    assert status["decode"] == {"replicas": 4, "readyReplicas": 4, "desiredReplicas": 4}
    assert status["routerEndpoint"] == "http://llama-8b-router.default.svc:8080"
    assert status["kvCompatHash"] == kv_compat_hash(effective(pds().spec))


def test_transition_time_moves_only_when_status_flips() -> None:
    first = compute(body(), snapshot(), now=T0)
    # Same world later: identical status, so no write.
    again = compute(body(first), snapshot(), now=T1)
    assert again == first
    assert st.status_patch(first, again) is None
    # Available flips: only its time moves; a reason change without a flip keeps the time.
    later = compute(body(first), healthy(), now=T1)
    times = {c["type"]: c["lastTransitionTime"] for c in later["conditions"]}
    assert times == {
        "Available": T1,
        "Progressing": T1,
        "Degraded": T0,
        "Ready": T1,
        "Reconciling": T1,
        "Stalled": T0,
    }


def test_invalid_spec_keeps_last_good_endpoint_and_reports_every_problem() -> None:
    good = compute(body(), healthy(), now=T0)
    problems = [Problem("spec.prefill.gpusPerPod", "too few"), Problem("spec.engine.sideChannelPort", "clash")]
    status = compute(body(good, generation=4), healthy(), problems=problems, now=T1)
    assert conditions(status) == {
        "Available": ("True", "MinimumReplicasAvailable"),
        "Progressing": ("False", "InvalidSpec"),
        "Degraded": ("True", "InvalidSpec"),
        "Ready": ("False", "InvalidSpec"),
        "Reconciling": ("False", "Stalled"),
        "Stalled": ("True", "InvalidSpec"),
    }
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["message"] == "spec.prefill.gpusPerPod: too few; spec.engine.sideChannelPort: clash"
    assert status["observedGeneration"] == 4
    assert status["routerEndpoint"] == good["routerEndpoint"]
    assert status["kvCompatHash"] == good["kvCompatHash"]


def test_status_patch_nulls_removed_keys() -> None:
    assert st.status_patch({"a": 1, "b": 2}, {"a": 1}) == {"a": 1, "b": None}
    assert st.status_patch(None, {"a": 1}) == {"a": 1}


def test_refused_apply_is_not_reported_as_complete() -> None:
    """The API server refused a child: it still runs the old spec, so Progressing must not say "all children are
    up to date" (`kubectl wait --for=condition=Progressing=False` would take the refused change as rolled out)."""
    errors = ["StatefulSet llama-8b-decode: HTTP 422 Invalid: spec.template: bad"]
    status = compute(body(), healthy(), apply_errors=errors, now=T0)
    assert conditions(status) == {
        "Available": ("True", "MinimumReplicasAvailable"),
        "Progressing": ("False", "ApplyFailed"),
        "Degraded": ("True", "ApplyFailed"),
        "Ready": ("False", "ApplyFailed"),
        "Reconciling": ("False", "Stalled"),
        "Stalled": ("True", "ApplyFailed"),
    }
    # While other children are still rolling out, that is what Progressing reports.
    rolling = snapshot(sts("prefill", 2, 1, updated=1, revisions=("r1", "r2")), sts("decode", 4, 4), router(2))
    status = compute(body(), rolling, apply_errors=errors, now=T0)
    assert conditions(status)["Progressing"] == ("True", "RollingOut")
    # Still stalled: the refusal needs a human even while other children roll out.
    assert conditions(status)["Stalled"] == ("True", "ApplyFailed")
    assert conditions(status)["Reconciling"] == ("False", "Stalled")


def test_a_child_conflict_is_stalled_and_names_the_object() -> None:
    """Another owner holds a child's name: nothing was applied, a human must act (delete, rename or hand it over)."""
    held = ["Role llama-8b-router exists and is not controlled by any owner, written by kubectl-create"]
    status = compute(body(), healthy(), apply_errors=["ignored: a conflict outranks it"], conflicts=held, now=T0)
    assert conditions(status) == {
        "Available": ("True", "MinimumReplicasAvailable"),
        "Progressing": ("False", "ChildConflict"),
        "Degraded": ("True", "ChildConflict"),
        "Ready": ("False", "ChildConflict"),
        "Reconciling": ("False", "Stalled"),
        "Stalled": ("True", "ChildConflict"),
    }
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["message"].startswith(held[0] + "; pdserve does not take over objects it did not create")


def _kstatus(objects: list[dict[str, Any]]) -> list[dict[str, str]]:
    """kstatus' own verdict (sigs.k8s.io/cli-utils pkg/kstatus, built from the Go module proxy and cached)."""
    binary = tools.kstatus_binary()
    proc = subprocess.run(
        [str(binary)], input=json.dumps(objects), capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    verdicts: list[dict[str, str]] = json.loads(proc.stdout)
    return verdicts


def test_kstatus_reads_every_status_as_the_conditions_say() -> None:
    """Feed the real kstatus library (what Flux, kpt and cli-utils run) every status of the table: Ready means
    Current, Reconciling InProgress, Stalled Failed; and a status of an older generation is never Current."""
    objects, expected = [], []
    for snap, conds in CASES:
        objects.append(body(compute(body(), snap, now=T0)))
        verdict = {"Ready": "Current", "Reconciling": "InProgress", "Stalled": "Failed"}
        expected.append(next(verdict[t] for t in verdict if conds[t][0] == "True"))
    problems = [Problem("spec.prefill.gpusPerPod", "too few")]
    objects.append(body(compute(body(), healthy(), problems=problems, now=T0)))
    expected.append("Failed")
    objects.append(body(compute(body(), healthy(), conflicts=["Role llama-8b-router exists"], now=T0)))
    expected.append("Failed")
    # The user edited the spec (generation 4) and the operator has not acted on it yet: the Ready status it wrote
    # for generation 3 must not count.
    objects.append(body(compute(body(), healthy(), now=T0), generation=4))
    expected.append("InProgress")
    # No status at all (no operator running): kstatus' rule for kinds it does not know says Current. Recorded here
    # because it is why docs/gitops.md asks Flux users for healthCheckExprs and why Argo CD's health.lua says
    # Progressing for it.
    objects.append(body())
    expected.append("Current")

    verdicts = _kstatus(objects)
    assert [v["status"] for v in verdicts] == expected, verdicts
    # kstatus repeats the Stalled/Reconciling message: what `flux get` or `kpt live status` shows.
    first_stalled = expected.index("Failed")
    assert verdicts[first_stalled]["message"] == next(
        c["message"] for c in objects[first_stalled]["status"]["conditions"] if c["type"] == "Stalled"
    )
