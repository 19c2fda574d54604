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
- Degraded: the first of InvalidSpec, ApplyFailed, PodsPending (the scheduler's own message), CrashLooping,
  ImagePullFailed, RouterUnavailable (the router Deployment gave up: ProgressDeadlineExceeded/ReplicaFailure).
  False/AsExpected otherwise. Not-yet-ready pods that are simply starting are Progressing, not Degraded.

GitOps conditions (kstatus, the rules Flux, kpt and cli-utils apply; Argo CD's health check in gitops/ reads them
too), derived from the three above so that exactly one of them is True at any time:
- Ready: Available, nothing progressing, nothing degraded. kstatus reads Ready=True as Current.
- Stalled: the operator cannot make progress without a human: InvalidSpec, ApplyFailed (the API server refused a
  child), CrashLooping engines, RouterUnavailable (the router Deployment gave up). kstatus: Failed.
- Reconciling: everything else that is not Ready: children being applied or rolling out, pods pending (a cluster
  autoscaler may still add the GPU nodes), images being pulled, endpoints not ready yet. kstatus: InProgress.
Together with `observedGeneration` (written on every status write; kstatus reports InProgress until it equals
`metadata.generation`) this gives GitOps tools a verdict that never passes vacuously.

`merge_conditions` keeps `lastTransitionTime` of a condition whose status did not change, so an unchanged world
computes a byte-identical status and the reconcile writes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.api.defaults import EffectiveRouting, EffectiveSpec, effective
from pdserve.api.kvcompat import kv_compat_hash
from pdserve.api.v1alpha1 import PDService
from pdserve.api.validation import Problem
from pdserve_operator.render.names import ENGINE_ROLES, EngineRole, child_name
from pdserve_operator.render.router import router_endpoint

AVAILABLE = "Available"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
READY = "Ready"
RECONCILING = "Reconciling"
STALLED = "Stalled"
CONDITION_TYPES = (AVAILABLE, PROGRESSING, DEGRADED, READY, RECONCILING, STALLED)
STALLED_REASONS = frozenset({"InvalidSpec", "ApplyFailed", "CrashLooping", "RouterUnavailable"})
"""Degraded reasons that need a human (kstatus' Stalled); other Degraded reasons resolve on their own."""
# How many offending pods a condition message names before it says "and N more".
_MAX_PODS_IN_MESSAGE = 3


@dataclass
class Snapshot:
    """What the operator observed of one PDService's children."""

    children: Mapping[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict)
    pods: Sequence[dict[str, Any]] = ()
    endpoint_slices: Sequence[dict[str, Any]] = ()

    def child(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.children.get((kind, namespace, name))


@dataclass(frozen=True)
class ConditionValue:
    """A condition without its transition time (that is decided by `merge_conditions`)."""

    type: str
    status: str
    reason: str
    message: str = ""


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
    crashing: list[str]
    pull_failures: list[str]


def available_condition(facts: Facts) -> ConditionValue:
    prefill, decode = facts.pools.get("prefill"), facts.pools.get("decode")
    if decode is None or decode["readyReplicas"] < 1:
        return ConditionValue(AVAILABLE, "False", "DecodeUnavailable", "no decode engine is ready")
    prefill_ok = prefill is not None and prefill["readyReplicas"] >= 1
    prefill_optional = prefill is not None and prefill["desiredReplicas"] == 0 and facts.fallback_to_decode
    if not (prefill_ok or prefill_optional):
        return ConditionValue(AVAILABLE, "False", "PrefillUnavailable", "no prefill engine is ready")
    if facts.router_ready < 1:
        return ConditionValue(AVAILABLE, "False", "RouterUnavailable", "no router pod is ready")
    if facts.router_endpoints < 1:
        return ConditionValue(AVAILABLE, "False", "RouterUnavailable", "the router Service has no ready endpoint")
    message = (
        f"prefill {prefill['readyReplicas'] if prefill else 0}/{prefill['desiredReplicas'] if prefill else 0}, "
        f"decode {decode['readyReplicas']}/{decode['desiredReplicas']}, router {facts.router_ready} ready"
    )
    return ConditionValue(AVAILABLE, "True", "MinimumReplicasAvailable", message)


def progressing_condition(facts: Facts, applied: bool, apply_errors: Sequence[str] = ()) -> ConditionValue:
    if applied:
        return ConditionValue(PROGRESSING, "True", "Applying", "the operator applied changed children")
    if facts.progress:
        return ConditionValue(PROGRESSING, "True", "RollingOut", _summarise(facts.progress))
    if apply_errors:
        # A refused child still runs the previous spec: stalled, not complete (like a Deployment's
        # ProgressDeadlineExceeded). The Degraded condition carries the server's message.
        return ConditionValue(
            PROGRESSING, "False", "ApplyFailed", "the API server refused some children; see the Degraded condition"
        )
    return ConditionValue(PROGRESSING, "False", "Complete", "all children are up to date")


def degraded_condition(facts: Facts, apply_errors: Sequence[str]) -> ConditionValue:
    if apply_errors:
        return ConditionValue(DEGRADED, "True", "ApplyFailed", _summarise(list(apply_errors)))
    if facts.pending:
        return ConditionValue(DEGRADED, "True", "PodsPending", _summarise(facts.pending))
    if facts.crashing:
        return ConditionValue(DEGRADED, "True", "CrashLooping", _summarise(facts.crashing))
    if facts.pull_failures:
        return ConditionValue(DEGRADED, "True", "ImagePullFailed", _summarise(facts.pull_failures))
    if facts.router_failure:
        return ConditionValue(DEGRADED, "True", "RouterUnavailable", facts.router_failure)
    return ConditionValue(DEGRADED, "False", "AsExpected", "")


def gitops_conditions(
    available: ConditionValue, progressing: ConditionValue, degraded: ConditionValue
) -> list[ConditionValue]:
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
        ConditionValue(READY, "True", "AllReady", available.message)
        if ready
        else ConditionValue(READY, "False", cause.reason, cause.message),
        ConditionValue(RECONCILING, "True", cause.reason, cause.message)
        if reconciling
        else ConditionValue(RECONCILING, "False", "Stalled" if stalled else "Complete", ""),
        ConditionValue(STALLED, "True", cause.reason, cause.message)
        if stalled
        else ConditionValue(STALLED, "False", "AsExpected", ""),
    ]


def merge_conditions(
    old: Sequence[Mapping[str, Any]], new: Sequence[ConditionValue], generation: int | None, now: str
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


def _facts(spec: EffectiveSpec | None, body: Mapping[str, Any], snapshot: Snapshot) -> Facts:
    namespace = body["metadata"].get("namespace", "default")
    name = body["metadata"]["name"]
    pools: dict[str, dict[str, int]] = {}
    progress: list[str] = []
    for role in ENGINE_ROLES:
        sts = snapshot.child("StatefulSet", namespace, child_name(name, role))
        desired = _desired(spec, role, sts)
        pools[role] = pool_status(sts, desired)
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
        fallback_to_decode=(
            spec.router.routing.fallback_to_decode if spec is not None else EffectiveRouting.fallback_to_decode
        ),
        router_failure=_deployment_failure(deploy),
        pending=unschedulable_pods(snapshot.pods),
        crashing=waiting_containers(snapshot.pods, frozenset({"CrashLoopBackOff"})),
        pull_failures=waiting_containers(
            snapshot.pods, frozenset({"ImagePullBackOff", "ErrImagePull", "InvalidImageName"})
        ),
    )


def _desired(spec: EffectiveSpec | None, role: EngineRole, sts: Mapping[str, Any] | None) -> int:
    if spec is not None:
        pool = spec.pool(role)
        if pool.autoscaling.enabled and sts is not None:
            # The autoscaler owns the replicas of an autoscaled pool: report what it asked for.
            return _int(sts, "spec", "replicas")
        return pool.desired_replicas
    return _int(sts, "spec", "replicas")


def compute_status(
    body: Mapping[str, Any],
    snapshot: Snapshot,
    *,
    pds: PDService | None,
    problems: Sequence[Problem] = (),
    apply_errors: Sequence[str] = (),
    applied: bool = False,
    now: str,
) -> dict[str, Any]:
    """The complete `.status` for a PDService (`pds` is None when the spec could not be parsed at all)."""
    old: Mapping[str, Any] = body.get("status") or {}
    generation = body["metadata"].get("generation")
    spec = effective(pds.spec) if pds is not None else None
    facts = _facts(spec, body, snapshot)
    available = available_condition(facts)
    if problems:
        message = "; ".join(str(problem) for problem in problems)
        progressing = ConditionValue(
            PROGRESSING, "False", "InvalidSpec", "the spec is invalid; children were left unchanged"
        )
        degraded = ConditionValue(DEGRADED, "True", "InvalidSpec", message)
    else:
        progressing = progressing_condition(facts, applied, apply_errors)
        degraded = degraded_condition(facts, apply_errors)
    conditions = [available, progressing, degraded, *gitops_conditions(available, progressing, degraded)]
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "conditions": merge_conditions(old.get("conditions") or [], conditions, generation, now),
        "prefill": facts.pools["prefill"],
        "decode": facts.pools["decode"],
    }
    if pds is not None and spec is not None and not problems:
        status["routerEndpoint"] = router_endpoint(pds, spec)
        status["kvCompatHash"] = kv_compat_hash(spec)
    else:
        # Children still run the last valid spec: keep reporting what they serve.
        for key in ("routerEndpoint", "kvCompatHash"):
            if old.get(key) is not None:
                status[key] = old[key]
    return status


def status_patch(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> dict[str, Any] | None:
    """A JSON merge patch turning `old` into `new` (None when equal): removed keys become null."""
    old = old or {}
    if dict(old) == dict(new):
        return None
    patch: dict[str, Any] = dict(new)
    for key in old:
        if key not in new:
            patch[key] = None
    return patch
