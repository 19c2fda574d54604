"""Pure status computation: observed children -> PDService `.status`, with conditions that only flip when they must.

Inputs are plain dicts as the API server returns them (StatefulSets, the router Deployment, engine and router Pods,
the router Service's EndpointSlices), so every rule is table-testable without a cluster.

Conditions (metav1.Condition shape, the Deployment convention):
- Available: both pools have a ready engine (a pool with 0 desired replicas never counts as available for decode;
  an empty prefill pool is fine only if decode can prefill, i.e. routing.fallbackToDecode) and the router has a
  ready pod *and* a ready endpoint in its Service. `kubectl wait --for=condition=Available` waits for this.
- Progressing: a child is missing, being applied, scaling, or rolling out (StatefulSet revisions differ, the
  controllers have not observed the latest generation, or not all replicas are updated and ready). False/Complete
  once all of that is done, False/ApplyFailed instead when the API server refused a child (it runs the old spec).
- Degraded: the first of InvalidSpec, ChildConflict (a child's name is held by an object another owner created:
  the operator takes nothing over and applies nothing, `plan.py`), ApplyFailed, PodsPending (the scheduler's own
  message), CrashLooping,
  EngineCrashed/RouterCrashed, ImagePullFailed, RouterUnavailable (the router Deployment gave up:
  ProgressDeadlineExceeded/ReplicaFailure). False/AsExpected otherwise. Not-yet-ready pods that are simply starting
  are Progressing, not Degraded.

Crashed containers (the rules of `container_crashes`): a container of one of our pods that terminated and was
restarted (`lastState.terminated`) is reported from the first crash, without waiting for the kubelet's
CrashLoopBackOff (which a container that crashes once never reaches: the kubelet restarts it at once). The message
names the pod and container, the exit code, the termination reason and time, and the restart count; it depends on
nothing but the crash, so an unchanged crash never rewrites the status or posts another Event. A crash counts until
the container has been running *and* ready for `crash_window` seconds (`--crash-recovery-seconds`; the time is
taken from the container's `startedAt` and the pod's Ready transition): a container that restarts, starts and
fails its readiness probe again stays reported instead of flapping between Degraded and not. The reconcile asks to
be re-run when that window ends (`next_check_seconds`): nothing else would trigger the pass that clears it.
- EngineCrashed (RouterCrashed when only router pods crashed): a container crashed and is restarting or running
  again. The kubelet is already restarting it and it may well recover by itself: kstatus Reconciling, not Stalled.
- CrashLooping: a container is waiting in CrashLoopBackOff (it crashed again after a restart). It stays CrashLooping,
  not EngineCrashed, while the kubelet's next restart runs it (the previous status is the memory), until the
  container has been ready for the window: a crash loop is Stalled for its whole length, not every other minute.

GitOps conditions (kstatus, the rules Flux, kpt and cli-utils apply; Argo CD's health check in gitops/ reads them
too), derived from the three above so that exactly one of them is True at any time:
- Ready: Available, nothing progressing, nothing degraded. kstatus reads Ready=True as Current.
- Stalled: the operator cannot make progress without a human: InvalidSpec, ChildConflict, ApplyFailed (the API
  server refused a child), CrashLooping containers, RouterUnavailable (the router Deployment gave up). kstatus:
  Failed.
- Reconciling: everything else that is not Ready: children being applied or rolling out, pods pending (a cluster
  autoscaler may still add the GPU nodes), images being pulled, a container that crashed once and is being
  restarted (EngineCrashed/RouterCrashed), endpoints not ready yet. kstatus: InProgress.
Together with `observedGeneration` (written on every status write; kstatus reports InProgress until it equals
`metadata.generation`) this gives GitOps tools a verdict that never passes vacuously.

Autoscaling: while a pool has autoscaling enabled, `status.<pool>.autoscaling` says who scales it and what was
decided last, and while a pool is scaled by pdserve the HPA-style conditions `ScalingActive`, `AbleToScale` and
`ScalingLimited` follow the six above. They come from the autoscaler's latest report, turned into status fields by
`autoscaler.report` and handed in by the reconcile as values (`Intent`); they never feed
Available/Progressing/Degraded or the kstatus verdict: an autoscaler that cannot act leaves a service exactly as
ready as it was.

What the spec asks (desired replicas, the router's endpoint, the kv-compat hash) is handed in the same way: this
module reads no spec and calls neither the renderer nor the autoscaler, so it sits beside them in the operator's
layers, not above them.

`merge_conditions` keeps `lastTransitionTime` of a condition whose status did not change, so an unchanged world
computes a byte-identical status and the reconcile writes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from pdserve.api.validation import Problem
from pdserve_operator.conditions import Condition
from pdserve_operator.names import ENGINE_ROLES, ROLE_LABEL, EngineRole, child_name
from pdserve_operator.observed import Snapshot

AVAILABLE = "Available"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
READY = "Ready"
RECONCILING = "Reconciling"
STALLED = "Stalled"
CONDITION_TYPES = (AVAILABLE, PROGRESSING, DEGRADED, READY, RECONCILING, STALLED)
STALLED_REASONS = frozenset({"InvalidSpec", "ChildConflict", "ApplyFailed", "CrashLooping", "RouterUnavailable"})
"""Degraded reasons that need a human (kstatus' Stalled); other Degraded reasons resolve on their own."""
# How many offending pods a condition message names before it says "and N more".
_MAX_PODS_IN_MESSAGE = 3
# Characters of a container's termination message quoted in a condition (it may be a whole stack trace).
_MAX_TERMINATION_MESSAGE = 200


@dataclass(frozen=True)
class Intent:
    """What the spec asks, as the values status reports: computed by the reconcile from the validation result (its
    effective spec, the router's Service, the autoscaler's report), never derived here.

    `desired`: each pool's desired replicas; None where the pool's StatefulSet decides (its `spec.replicas`: an
    autoscaled pool's scaler, or a spec that did not parse). `fallback_to_decode`: whether decode may prefill
    itself (then an empty prefill pool is still Available). `router_endpoint` and `kv_compat_hash`: what the
    children serve; None while the spec is invalid (the children still run the last valid spec: the status keeps
    what it said). `autoscaling` and `scaling_conditions`: `status.<pool>.autoscaling` and the scaling conditions
    (`autoscaler.report`), placed as they are after the six conditions status decides itself."""

    desired: Mapping[EngineRole, int | None]
    fallback_to_decode: bool
    router_endpoint: str | None
    kv_compat_hash: str | None
    autoscaling: Mapping[EngineRole, Mapping[str, Any]]
    scaling_conditions: Sequence[Condition]
    kv_store: Mapping[str, Any] | None = None
    """`status.kvStore` (`kvstore_status`); None without a store, or while the spec is invalid (then kept)."""
    threshold: Mapping[str, Any] | None = None
    """`status.disaggregationThreshold` (`autoscaler.report.threshold_view`); None while the spec does not let the
    autoscaler choose it, or while the spec is invalid (then kept)."""


# ------------------------------------------------------------------------------------------------- pool summaries


def _int(obj: Mapping[str, Any] | None, *path: str) -> int:
    value: Any = obj
    for part in path:
        if not isinstance(value, Mapping):
            return 0
        value = value.get(part)
    return value if isinstance(value, int) else 0


def pool_status(sts: Mapping[str, Any] | None, desired: int) -> dict[str, int]:
    return {
        "replicas": _int(sts, "status", "replicas"),
        "readyReplicas": _int(sts, "status", "readyReplicas"),
        "desiredReplicas": desired,
    }


def statefulset_progress(sts: Mapping[str, Any]) -> str | None:
    """Why a StatefulSet is still converging, or None when it is done."""
    spec_replicas = _int(sts, "spec", "replicas")
    status = sts.get("status") or {}
    generation = _int(sts, "metadata", "generation")
    if _int(sts, "status", "observedGeneration") < generation:
        return "the controller has not observed the latest template"
    update, current = status.get("updateRevision"), status.get("currentRevision")
    if _int(sts, "status", "updatedReplicas") < spec_replicas or (update and current and update != current):
        return f"rolling update: {_int(sts, 'status', 'updatedReplicas')}/{spec_replicas} pods updated"
    if _int(sts, "status", "replicas") != spec_replicas:
        return f"scaling: {_int(sts, 'status', 'replicas')} -> {spec_replicas} pods"
    if _int(sts, "status", "readyReplicas") < spec_replicas:
        return f"{_int(sts, 'status', 'readyReplicas')}/{spec_replicas} pods ready"
    return None


def deployment_progress(deploy: Mapping[str, Any]) -> str | None:
    """Why a Deployment is still converging, or None when it is done."""
    spec_replicas = _int(deploy, "spec", "replicas")
    if _int(deploy, "status", "observedGeneration") < _int(deploy, "metadata", "generation"):
        return "the controller has not observed the latest template"
    if _int(deploy, "status", "updatedReplicas") < spec_replicas:
        return f"rolling update: {_int(deploy, 'status', 'updatedReplicas')}/{spec_replicas} pods updated"
    if _int(deploy, "status", "replicas") > spec_replicas:
        return "old pods are terminating"
    if _int(deploy, "status", "availableReplicas") < spec_replicas:
        return f"{_int(deploy, 'status', 'availableReplicas')}/{spec_replicas} pods available"
    return None


def ready_endpoints(slices: Iterable[Mapping[str, Any]]) -> int:
    """Ready addresses over the router Service's EndpointSlices (`ready` absent means ready, per the API)."""
    count = 0
    for slice_ in slices:
        for endpoint in slice_.get("endpoints") or []:
            if (endpoint.get("conditions") or {}).get("ready", True) is not False:
                count += len(endpoint.get("addresses") or [])
    return count


# ----------------------------------------------------------------------------------------------- pod diagnostics


def _pod_condition(pod: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == type_:
            return condition  # type: ignore[no-any-return]
    return None


def _summarise(items: list[str]) -> str:
    head = "; ".join(items[:_MAX_PODS_IN_MESSAGE])
    extra = len(items) - _MAX_PODS_IN_MESSAGE
    return f"{head}; and {extra} more" if extra > 0 else head


def unschedulable_pods(pods: Iterable[Mapping[str, Any]]) -> list[str]:
    """`pod: scheduler message` for every pod the scheduler could not place."""
    found = []
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        if (pod.get("status") or {}).get("phase") not in (None, "Pending"):
            continue
        scheduled = _pod_condition(pod, "PodScheduled")
        if scheduled and scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
            found.append(f"{pod['metadata']['name']}: {scheduled.get('message') or 'unschedulable'}")
    return found


def waiting_containers(pods: Iterable[Mapping[str, Any]], reasons: frozenset[str]) -> list[str]:
    """`pod/container: reason (message)` for containers waiting for one of `reasons`."""
    found = []
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        for container in statuses:
            waiting = (container.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in reasons:
                restarts = container.get("restartCount", 0)
                detail = waiting.get("message") or f"{restarts} restarts"
                found.append(f"{pod['metadata']['name']}/{container.get('name')}: {waiting['reason']} ({detail})")
    return found


def parse_time(value: object) -> datetime | None:
    """An RFC 3339 timestamp as the API server writes it (`2026-01-01T00:00:00Z`), or None."""
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


@dataclass(frozen=True)
class Crash:
    """One container of one of our pods that crashed and has not been running and ready for the window since."""

    pod: str
    container: str
    role: str  # the pod's pdserve.io/role ("" when unlabelled)
    exit_code: int | None  # None: in CrashLoopBackOff with no recorded termination
    reason: str  # the termination reason: Error, OOMKilled, ...
    finished_at: str
    restarts: int
    termination_message: str
    backing_off: bool  # waiting in CrashLoopBackOff right now
    recovers_at: datetime | None  # running and ready: when the window ends; None while not ready

    def describe(self) -> str:
        """`pod/container: exited with code 70 (Error) at T, 1 restart[: message]`; only facts of the crash, never
        its current state, so the text stays the same from the crash to the recovery."""
        restarts = f"{self.restarts} restart{'s' if self.restarts != 1 else ''}"
        if self.exit_code is None:
            return f"{self.pod}/{self.container}: CrashLoopBackOff ({restarts})"
        text = f"{self.pod}/{self.container}: exited with code {self.exit_code} ({self.reason or 'Error'})"
        if self.finished_at:
            text += f" at {self.finished_at}"
        text += f", {restarts}"
        if self.termination_message:
            text += f": {self.termination_message}"
        return text


def _ready_since(pod: Mapping[str, Any], running: Mapping[str, Any]) -> datetime | None:
    """Since when a running, ready container has been so: the later of its start and the pod's Ready transition."""
    times = [parse_time(running.get("startedAt"))]
    ready = _pod_condition(pod, "Ready")
    if ready is not None and ready.get("status") == "True":
        times.append(parse_time(ready.get("lastTransitionTime")))
    known = [t for t in times if t is not None]
    return max(known) if known else None


def _unready_after(pod: Mapping[str, Any], running: Mapping[str, Any], window: float) -> bool:
    """Whether a running container that is not ready now ran for the window after its restart before the pod
    turned unready: that crash is over, the unreadiness is news of its own (Progressing shows it), and reporting
    the old crash again would blame it on something days old."""
    started = parse_time(running.get("startedAt"))
    ready = _pod_condition(pod, "Ready")
    turned = parse_time(ready.get("lastTransitionTime")) if ready and ready.get("status") != "True" else None
    return started is not None and turned is not None and (turned - started).total_seconds() >= window


def container_crashes(pods: Iterable[Mapping[str, Any]], now: datetime, window: float) -> list[Crash]:
    """Every container that crashed and has not recovered yet (see the module docstring), pods in name order.

    A container counts when it was restarted after a termination (`restartCount` > 0 and `lastState.terminated`)
    or is waiting in CrashLoopBackOff, until it is running, ready, and has been both for `window` seconds. A
    running, ready container with no timestamps at all counts as recovered (nothing could ever clear it), and so
    does a running container whose pod turned unready at least `window` seconds after it started (it recovered
    before; see `_unready_after`)."""
    found = []
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        role = str((pod["metadata"].get("labels") or {}).get(ROLE_LABEL, ""))
        for container in (pod.get("status") or {}).get("containerStatuses") or []:
            state = container.get("state") or {}
            last = (container.get("lastState") or {}).get("terminated") or {}
            restarts = container.get("restartCount", 0)
            backing_off = (state.get("waiting") or {}).get("reason") == "CrashLoopBackOff"
            if not backing_off and not (last and isinstance(restarts, int) and restarts > 0):
                continue
            recovers_at = None
            running = state.get("running")
            if running is not None and container.get("ready") is True:
                since = _ready_since(pod, running)
                if since is None or (now - since).total_seconds() >= window:
                    continue
                recovers_at = since + timedelta(seconds=window)
            elif running is not None and _unready_after(pod, running, window):
                continue
            message = " ".join(str(last.get("message") or "").split())
            if len(message) > _MAX_TERMINATION_MESSAGE:
                message = message[: _MAX_TERMINATION_MESSAGE - 3] + "..."
            found.append(
                Crash(
                    pod=pod["metadata"]["name"],
                    container=str(container.get("name")),
                    role=role,
                    exit_code=last["exitCode"] if isinstance(last.get("exitCode"), int) else None,
                    reason=str(last.get("reason") or ""),
                    finished_at=str(last.get("finishedAt") or ""),
                    restarts=restarts if isinstance(restarts, int) else 0,
                    termination_message=message,
                    backing_off=backing_off,
                    recovers_at=recovers_at,
                )
            )
    return found


def _deployment_failure(deploy: Mapping[str, Any] | None) -> str | None:
    for condition in (deploy or {}).get("status", {}).get("conditions") or []:
        if condition.get("type") == "Progressing" and condition.get("status") == "False":
            return str(condition.get("message") or condition.get("reason"))
        if condition.get("type") == "ReplicaFailure" and condition.get("status") == "True":
            return str(condition.get("message") or condition.get("reason"))
    return None


# --------------------------------------------------------------------------------------------------- conditions


@dataclass(frozen=True)
class Facts:
    """Everything the conditions depend on, computed once from the snapshot."""

    pools: Mapping[str, dict[str, int]]
    router_ready: int
    router_endpoints: int
    progress: list[str]
    fallback_to_decode: bool
    router_failure: str | None
    pending: list[str]
    crashes: list[Crash]
    pull_failures: list[str]


def available_condition(facts: Facts) -> Condition:
    prefill, decode = facts.pools.get("prefill"), facts.pools.get("decode")
    if decode is None or decode["readyReplicas"] < 1:
        return Condition(AVAILABLE, "False", "DecodeUnavailable", "no decode engine is ready")
    prefill_ok = prefill is not None and prefill["readyReplicas"] >= 1
    prefill_optional = prefill is not None and prefill["desiredReplicas"] == 0 and facts.fallback_to_decode
    if not (prefill_ok or prefill_optional):
        return Condition(AVAILABLE, "False", "PrefillUnavailable", "no prefill engine is ready")
    if facts.router_ready < 1:
        return Condition(AVAILABLE, "False", "RouterUnavailable", "no router pod is ready")
    if facts.router_endpoints < 1:
        return Condition(AVAILABLE, "False", "RouterUnavailable", "the router Service has no ready endpoint")
    message = (
        f"prefill {prefill['readyReplicas'] if prefill else 0}/{prefill['desiredReplicas'] if prefill else 0}, "
        f"decode {decode['readyReplicas']}/{decode['desiredReplicas']}, router {facts.router_ready} ready"
    )
    return Condition(AVAILABLE, "True", "MinimumReplicasAvailable", message)


def progressing_condition(
    facts: Facts, applied: bool, apply_errors: Sequence[str] = (), conflicts: Sequence[str] = ()
) -> Condition:
    if conflicts:
        return Condition(
            PROGRESSING,
            "False",
            "ChildConflict",
            "children were left unchanged: another owner holds a child's name; see the Degraded condition",
        )
    if applied:
        return Condition(PROGRESSING, "True", "Applying", "the operator applied changed children")
    if facts.progress:
        return Condition(PROGRESSING, "True", "RollingOut", _summarise(facts.progress))
    if apply_errors:
        # A refused child still runs the previous spec: stalled, not complete (like a Deployment's
        # ProgressDeadlineExceeded). The Degraded condition carries the server's message.
        return Condition(
            PROGRESSING, "False", "ApplyFailed", "the API server refused some children; see the Degraded condition"
        )
    return Condition(PROGRESSING, "False", "Complete", "all children are up to date")


def degraded_condition(
    facts: Facts, apply_errors: Sequence[str], previous_reason: str | None = None, conflicts: Sequence[str] = ()
) -> Condition:
    """The first Degraded reason that applies. `previous_reason` is the Degraded reason of the current status: a
    crash loop stays CrashLooping between the kubelet's back-offs (see the module docstring). `conflicts`: the
    children whose names other owners hold (`plan.Conflict`)."""
    if conflicts:
        message = (
            f"{_summarise(list(conflicts))}; pdserve does not take over objects it did not create: delete or "
            "rename them, or hand one over by giving it this PDService's controller reference"
        )
        return Condition(DEGRADED, "True", "ChildConflict", message)
    if apply_errors:
        return Condition(DEGRADED, "True", "ApplyFailed", _summarise(list(apply_errors)))
    if facts.pending:
        return Condition(DEGRADED, "True", "PodsPending", _summarise(facts.pending))
    if facts.crashes:
        message = _summarise([crash.describe() for crash in facts.crashes])
        if previous_reason == "CrashLooping" or any(crash.backing_off for crash in facts.crashes):
            return Condition(DEGRADED, "True", "CrashLooping", message)
        engines = any(crash.role != "router" for crash in facts.crashes)
        return Condition(DEGRADED, "True", "EngineCrashed" if engines else "RouterCrashed", message)
    if facts.pull_failures:
        return Condition(DEGRADED, "True", "ImagePullFailed", _summarise(facts.pull_failures))
    if facts.router_failure:
        return Condition(DEGRADED, "True", "RouterUnavailable", facts.router_failure)
    return Condition(DEGRADED, "False", "AsExpected", "")


def gitops_conditions(available: Condition, progressing: Condition, degraded: Condition) -> list[Condition]:
    """Ready, Reconciling and Stalled (kstatus semantics) from the three core conditions; exactly one is True."""
    stalled = degraded.status == "True" and degraded.reason in STALLED_REASONS
    ready = available.status == "True" and progressing.status != "True" and degraded.status != "True"
    if stalled:
        cause = degraded
    elif degraded.status == "True":
        cause = degraded  # e.g. PodsPending: more telling than "RollingOut"
    elif progressing.status == "True":
        cause = progressing
    else:
        cause = available  # e.g. the router's endpoints are not ready yet
    reconciling = not (ready or stalled)
    return [
        Condition(READY, "True", "AllReady", available.message)
        if ready
        else Condition(READY, "False", cause.reason, cause.message),
        Condition(RECONCILING, "True", cause.reason, cause.message)
        if reconciling
        else Condition(RECONCILING, "False", "Stalled" if stalled else "Complete", ""),
        Condition(STALLED, "True", cause.reason, cause.message)
        if stalled
        else Condition(STALLED, "False", "AsExpected", ""),
    ]


def merge_conditions(
    old: Sequence[Mapping[str, Any]], new: Sequence[Condition], generation: int | None, now: str
) -> list[dict[str, Any]]:
    """metav1.Conditions for `new`, keeping each old lastTransitionTime whose status did not flip."""
    previous = {c.get("type"): c for c in old}
    merged = []
    for value in new:
        before = previous.get(value.type)
        keep = before is not None and before.get("status") == value.status and before.get("lastTransitionTime")
        condition: dict[str, Any] = {
            "type": value.type,
            "status": value.status,
            "lastTransitionTime": before["lastTransitionTime"] if keep and before else now,
            "reason": value.reason,
            "message": value.message,
        }
        if generation is not None:
            condition["observedGeneration"] = generation
        merged.append(condition)
    return merged


# ------------------------------------------------------------------------------------------------------- status


def facts_of(body: Mapping[str, Any], snapshot: Snapshot, intent: Intent, now: str, crash_window: float) -> Facts:
    """Everything the conditions depend on, from the snapshot, once per pass (the crashed containers among them,
    which `next_check_seconds` reads too). `crash_window`: how long a crashed container must be running and ready
    again before it stops counting (`--crash-recovery-seconds`)."""
    namespace = body["metadata"].get("namespace", "default")
    name = body["metadata"]["name"]
    moment = parse_time(now) or datetime.now(UTC)
    pools: dict[str, dict[str, int]] = {}
    progress: list[str] = []
    for role in ENGINE_ROLES:
        sts = snapshot.child("StatefulSet", namespace, child_name(name, role))
        desired = intent.desired.get(role)
        pools[role] = pool_status(sts, _int(sts, "spec", "replicas") if desired is None else desired)
        if sts is None:
            progress.append(f"StatefulSet {child_name(name, role)} does not exist yet")
        else:
            why = statefulset_progress(sts)
            if why:
                progress.append(f"{role}: {why}")
    deploy = snapshot.child("Deployment", namespace, child_name(name, "router"))
    if deploy is None:
        progress.append(f"Deployment {child_name(name, 'router')} does not exist yet")
    else:
        why = deployment_progress(deploy)
        if why:
            progress.append(f"router: {why}")
    return Facts(
        pools=pools,
        router_ready=_int(deploy, "status", "readyReplicas"),
        router_endpoints=ready_endpoints(snapshot.endpoint_slices),
        progress=progress,
        fallback_to_decode=intent.fallback_to_decode,
        router_failure=_deployment_failure(deploy),
        pending=unschedulable_pods(snapshot.pods),
        crashes=container_crashes(snapshot.pods, moment, crash_window),
        pull_failures=waiting_containers(
            snapshot.pods, frozenset({"ImagePullBackOff", "ErrImagePull", "InvalidImageName"})
        ),
    )


def compute_status(
    body: Mapping[str, Any],
    facts: Facts,
    intent: Intent,
    *,
    problems: Sequence[Problem] = (),
    apply_errors: Sequence[str] = (),
    conflicts: Sequence[str] = (),
    applied: bool = False,
    now: str,
) -> dict[str, Any]:
    """The complete `.status` for a PDService from the facts of this pass (`facts_of`) and what its spec asks
    (`intent`). `problems`: why the spec is invalid (nothing was applied); `apply_errors`: children the API server
    refused; `conflicts`: children whose names other owners hold (nothing was applied); `applied`: whether this
    pass applied or pruned children."""
    old: Mapping[str, Any] = body.get("status") or {}
    generation = body["metadata"].get("generation")
    available = available_condition(facts)
    if problems:
        message = "; ".join(str(problem) for problem in problems)
        progressing = Condition(
            PROGRESSING, "False", "InvalidSpec", "the spec is invalid; children were left unchanged"
        )
        degraded = Condition(DEGRADED, "True", "InvalidSpec", message)
    else:
        progressing = progressing_condition(facts, applied, apply_errors, conflicts)
        previous: Mapping[str, Any] = next(
            (c for c in old.get("conditions") or [] if c.get("type") == DEGRADED and c.get("status") == "True"), {}
        )
        degraded = degraded_condition(facts, apply_errors, previous.get("reason"), conflicts)
    conditions = [
        available,
        progressing,
        degraded,
        *gitops_conditions(available, progressing, degraded),
        *intent.scaling_conditions,
    ]
    pools: dict[str, dict[str, Any]] = {role: dict(facts.pools[role]) for role in ENGINE_ROLES}
    for role, fields in intent.autoscaling.items():
        pools[role]["autoscaling"] = dict(fields)
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "conditions": merge_conditions(old.get("conditions") or [], conditions, generation, now),
        "prefill": pools["prefill"],
        "decode": pools["decode"],
    }
    # Children still run the last valid spec while this one is invalid: keep reporting what they serve.
    for key, given in (("routerEndpoint", intent.router_endpoint), ("kvCompatHash", intent.kv_compat_hash)):
        value = given if given is not None else old.get(key)
        if value is not None:
            status[key] = value
    if intent.kv_store is not None:
        status["kvStore"] = dict(intent.kv_store)
    elif intent.kv_compat_hash is None and old.get("kvStore") is not None:
        status["kvStore"] = old["kvStore"]  # an invalid spec: the store runs as the last valid spec made it
    if intent.threshold is not None:
        status["disaggregationThreshold"] = dict(intent.threshold)
    elif intent.kv_compat_hash is None and old.get("disaggregationThreshold") is not None:
        status["disaggregationThreshold"] = old["disaggregationThreshold"]  # an invalid spec: routers keep it
    return status


def next_check_seconds(facts: Facts, now: str) -> float | None:
    """Seconds until the status would change with no event at all (a crashed container's recovery window ends),
    or None: the reconcile re-queues itself for then. Rounded up to whole seconds plus one, because the API
    server's timestamps (and `now`) have one-second resolution."""
    moment = parse_time(now)
    if moment is None:
        return None
    ends = [crash.recovers_at for crash in facts.crashes if crash.recovers_at]
    if not ends:
        return None
    return max(0.0, float(int((min(ends) - moment).total_seconds()) + 1))


def status_patch(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> dict[str, Any] | None:
    """A JSON merge patch turning `old` into `new` (None when equal): removed keys become null, at any depth (a
    merge patch merges nested maps, so a key dropped inside `prefill` must be nulled there too); lists and
    scalars are replaced whole."""
    old = old or {}
    if dict(old) == dict(new):
        return None
    return _merge_patch(old, new)


def _merge_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    patch: dict[str, Any] = {}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            patch[key] = _merge_patch(before, value)
        else:
            patch[key] = value
    for key in old:
        if key not in new:
            patch[key] = None
    return patch
