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
from pdserve.api.v1alpha1 import PDService
from pdserve.api.validation import Problem
from pdserve_dev.cluster import tools
from pdserve_operator import status as st

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
) -> st.Snapshot:
    return st.Snapshot(
        children={(c["kind"], "default", c["metadata"]["name"]): c for c in children},
        pods=pods or [],
        endpoint_slices=slices if slices is not None else [slice_()],
    )


def healthy() -> st.Snapshot:
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


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


# (observed children, expected conditions): the table every rule is checked against, here and by kstatus below.
CASES: list[tuple[st.Snapshot, dict[str, tuple[str, str]]]] = [
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
def test_conditions(snap: st.Snapshot, expected: dict[str, tuple[str, str]]) -> None:
    status = st.compute_status(body(), snap, pds=pds(), now=T0)
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
    degraded = next(
        c for c in st.compute_status(body(), snap, pds=pds(), now=T0)["conditions"] if c["type"] == "Degraded"
    )
    assert degraded["message"] == f"p-0: {message}"


def test_pool_status_router_endpoint_and_hash() -> None:
    status = st.compute_status(body(), healthy(), pds=pds(), now=T0)
    assert status["prefill"] == {"replicas": 2, "readyReplicas": 2, "desiredReplicas": 2}
    assert status["decode"] == {"replicas": 4, "readyReplicas": 4, "desiredReplicas": 4}
    assert status["routerEndpoint"] == "http://llama-8b-router.default.svc:8080"
    assert status["kvCompatHash"] == kv_compat_hash(effective(pds().spec))


def test_transition_time_moves_only_when_status_flips() -> None:
    first = st.compute_status(body(), snapshot(), pds=pds(), now=T0)
    # Same world later: identical status, so no write.
    again = st.compute_status(body(first), snapshot(), pds=pds(), now=T1)
    assert again == first
    assert st.status_patch(first, again) is None
    # Available flips: only its time moves; a reason change without a flip keeps the time.
    later = st.compute_status(body(first), healthy(), pds=pds(), now=T1)
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
    good = st.compute_status(body(), healthy(), pds=pds(), now=T0)
    problems = [Problem("spec.prefill.gpusPerPod", "too few"), Problem("spec.engine.sideChannelPort", "clash")]
    status = st.compute_status(body(good, generation=4), healthy(), pds=pds(), problems=problems, now=T1)
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
    status = st.compute_status(body(), healthy(), pds=pds(), apply_errors=errors, now=T0)
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
    status = st.compute_status(body(), rolling, pds=pds(), apply_errors=errors, now=T0)
    assert conditions(status)["Progressing"] == ("True", "RollingOut")
    # Still stalled: the refusal needs a human even while other children roll out.
    assert conditions(status)["Stalled"] == ("True", "ApplyFailed")
    assert conditions(status)["Reconciling"] == ("False", "Stalled")


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
        objects.append(body(st.compute_status(body(), snap, pds=pds(), now=T0)))
        verdict = {"Ready": "Current", "Reconciling": "InProgress", "Stalled": "Failed"}
        expected.append(next(verdict[t] for t in verdict if conds[t][0] == "True"))
    problems = [Problem("spec.prefill.gpusPerPod", "too few")]
    objects.append(body(st.compute_status(body(), healthy(), pds=pds(), problems=problems, now=T0)))
    expected.append("Failed")
    # The user edited the spec (generation 4) and the operator has not acted on it yet: the Ready status it wrote
    # for generation 3 must not count.
    objects.append(body(st.compute_status(body(), healthy(), pds=pds(), now=T0), generation=4))
    expected.append("InProgress")
    # No status at all (no operator running): kstatus' rule for kinds it does not know says Current. Recorded here
    # because it is why the README asks Flux users for healthCheckExprs and why Argo CD's health.lua says
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
