"""The one reconcile path: observed PDService + children -> applies, prunes, status. Level-triggered.

It never asks why it runs (create, update, a child's event, a resync timer, a restart): it reads the latest state
from the informer cache and runs three steps, each a function of its own:

1. plan (pure, `plan_writes`): render the validated spec (`view.SpecViews`: validated once per stored version,
   its effective spec derived once) against what the cluster shows, and plan the applies and prunes (`plan.py`).
   A child's name the cache does not hold is looked up first (`look_up`, one GET each): the cache only holds
   objects with pdserve's labels, and the planner must never create over an object another owner made under
   that name (`plan.Conflict`: Degraded/ChildConflict, nothing applied). Once the children exist, a pass reads
   nothing;
2. execute (IO, `executor.execute`): make exactly the writes the plan contains, with their Events;
3. status: what the spec asks as values (pure, `status_intent`: desired replicas, the router endpoint, the
   autoscaler's view), the status computed from them and the observed children (`status.py`), written only when
   it changed, with Events for the condition changes a user cares about (pure, `transition_events`).

Running it twice in a row makes no writes the second time.

What the render depends on beyond the spec (`render.Observed`) is read here: the kv-compat values the engine pods
carry (from the cache) and, when the router's topology needs node labels, the labels of the nodes those pods run on
(`nodes`, a cache of per-node reads: no request once every node is known).

Failure policy:
- Invalid spec (the shared validation finds problems the CRD could not): status Degraded/InvalidSpec with every
  problem, a Warning event when the problems change, children untouched, and *no* retry: nothing will change until
  the user edits the spec, which produces a watch event and a new pass.
- The API refused an object (4xx other than conflict/throttling): Degraded/ApplyFailed with the server's message
  and a Warning event when that message changes; no backoff retry (the next event or resync tries again).
- Transient errors (connection, 5xx, 409, 429): `RetryLaterError` after recording status where possible; the work queue
  re-queues the PDService with exponential backoff.
- Leadership lost (`NotLeaderError` from any write): propagates at once; the pass makes no further writes.

The objects of one wave are applied concurrently on `applier`, the runner's thread pool (`executor.py`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pdserve.api.defaults import EffectiveRouting, EffectiveSpec
from pdserve.api.kvcompat import KV_COMPAT_LABEL, kv_compat_hash
from pdserve.api.router_config import RouterControl
from pdserve.api.v1alpha1 import PDService
from pdserve.api.validation import Validated
from pdserve_operator import gateway_status
from pdserve_operator import plan as planner
from pdserve_operator import status as status_mod
from pdserve_operator.autoscaler.report import (
    SCALING_ACTIVE,
    ScalingBoard,
    ScalingReport,
    kept_view,
    status_view,
    threshold_view,
)
from pdserve_operator.executor import Executed, RetryLaterError, execute, post_event, write_status
from pdserve_operator.kinds import INFERENCE_POOL, MANAGED
from pdserve_operator.kube import ApiError, KubeIO
from pdserve_operator.names import ENGINE_ROLES, ROLE_LABEL, EngineRole, child_name
from pdserve_operator.nodes import NodeLabels
from pdserve_operator.observed import ObjectKey, Snapshot, key_of
from pdserve_operator.ownership import controlled_by, controller_of
from pdserve_operator.render import Observed, render
from pdserve_operator.render import gateway as gateway_render
from pdserve_operator.render.discovery import node_topology_labels
from pdserve_operator.render.kvcache import kv_store_status
from pdserve_operator.render.router import router_endpoint
from pdserve_operator.store import Store
from pdserve_operator.view import SpecViews

__all__ = [
    "ForeignPods",
    "Outcome",
    "RetryLaterError",
    "desired_children",
    "look_up",
    "observe",
    "plan_for",
    "plan_writes",
    "reconcile",
    "report_foreign_pods",
    "status_intent",
    "transition_events",
    "unknown_names",
    "update_status",
]

log = logging.getLogger("pdserve.operator.reconcile")

#: Seconds until a pass blocked by a ChildConflict looks at the names in the way again.
CONFLICT_RECHECK_S = 10.0


@dataclass
class Outcome:
    """What one pass did, for metrics, logs and tests."""

    result: str  # noop | status (only status changed) | applied | invalid | gone
    applied: list[str] = field(default_factory=list)
    pruned: list[str] = field(default_factory=list)
    status_written: bool = False
    events: list[str] = field(default_factory=list)
    # Run this PDService again after so many seconds even without an event: its status will change by then (a
    # crashed container's recovery window ends). None: only events and the periodic resync re-run it.
    requeue_after: float | None = None


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def reconcile(
    namespace: str,
    name: str,
    store: Store,
    api: KubeIO,
    now: Callable[[], str] = utc_now,
    *,
    views: SpecViews,
    crash_window: float,
    applier: Executor | None = None,
    scaling: ScalingBoard | None = None,
    nodes: NodeLabels | None = None,
    reported: ForeignPods | None = None,
) -> Outcome:
    """One pass for one PDService: plan -> execute -> status. Raises RetryLaterError (transient failure) or
    NotLeaderError (leadership lost).

    `views`: the validation result of each stored PDService under the administrator's policy (the operator's
    flags). `crash_window`: how long a crashed container must be running and ready again before it stops counting
    (`--crash-recovery-seconds`). `applier`: the thread pool a wave's applies share (None: one after the other).
    `scaling`: the autoscaler loops' reports, placed in status as they are (None: an operator without an
    autoscaler, like one started without --prometheus-url). `nodes`: where node labels come from
    (`nodes.NodeLabelCache`); None reads none (the discovery ConfigMap then lists no node). `reported`: the foreign
    pods already reported (`ForeignPods`: each gets one Warning Event); None reports none."""
    body = store.owner(namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return Outcome("gone")  # deleted: ownerReferences garbage-collect the children
    checked = views.checked(body)
    report = scaling.get((namespace, name)) if scaling is not None else None
    if checked.ok:
        snapshot = store.snapshot(namespace, name)
        spec = checked.require()[1]
        control = report.threshold.control() if report is not None and report.threshold is not None else None
        facts = observe(snapshot.pods, spec, nodes, services=snapshot.uids("Service"), router_control=control)
        desired = desired_children(checked, snapshot, facts)
        found, unreadable = look_up(api, unknown_names(desired, snapshot), applier)
        if unreadable:
            done = Executed(transient=unreadable)  # cannot tell whether a name is free: write nothing, retry
            outcome = Outcome("noop")
        else:
            writes = plan_for(desired, snapshot, body["metadata"]["uid"], found)
            done = execute(writes, body, store, api, applier=applier, now=now)
            outcome = Outcome("noop" if writes.empty else "applied", done.applied, done.pruned, events=done.events)
    else:
        _log_rejected(body, checked)
        done, outcome = Executed(), Outcome("invalid")
    update_status(
        body,
        checked,
        done,
        outcome,
        store=store,
        api=api,
        now=now,
        crash_window=crash_window,
        report=report,
        configured=scaling is not None and scaling.configured,
    )
    if reported is not None:
        outcome.events.extend(report_foreign_pods(body, store.snapshot(namespace, name), reported, api, now))
    if done.transient:
        raise RetryLaterError("; ".join(done.transient))
    return outcome


class ForeignPods:
    """The pods carrying a PDService's labels that it does not own (`Snapshot.foreign_pods`) and that were already
    reported, by UID, so each is reported once: thread-safe (reconcile workers share it), and it forgets a pod once
    it is gone (its memory is bounded by the foreign pods that exist)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str], set[str]] = {}

    def new(self, key: tuple[str, str], pods: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        """The pods of `pods` not reported before for PDService `key`; remembers `pods` as the ones reported."""
        uids = {str(p["metadata"].get("uid") or p["metadata"]["name"]): p for p in pods}
        with self._lock:
            seen = self._seen.get(key, set())
            if uids:
                self._seen[key] = set(uids)
            else:
                self._seen.pop(key, None)
        return [pod for uid, pod in uids.items() if uid not in seen]


def report_foreign_pods(
    body: dict[str, Any], snapshot: Snapshot, reported: ForeignPods, api: KubeIO, now: Callable[[], str]
) -> list[str]:
    """One Warning Event (and a log line) per pod that carries the PDService's labels but is not its workloads'
    (`ownership`): such a pod is ignored (status, the autoscaler, the router's engines), and its owner should know."""
    meta = body["metadata"]
    events = []
    for pod in reported.new((meta.get("namespace", "default"), meta["name"]), snapshot.foreign_pods):
        pod_meta = pod["metadata"]
        role = (pod_meta.get("labels") or {}).get(ROLE_LABEL, "")
        controller = controller_of(pod)
        held = (
            f"its controller is {controller.get('kind')} {controller.get('name')}"
            if controller
            else "it has no controller"
        )
        message = (
            f"Ignored pod {pod_meta['name']} (pdserve.io/role={role}): it carries this PDService's labels but {held}, "
            "not one of this PDService's StatefulSets or its router's ReplicaSets; it is not counted in status or by "
            "the autoscaler, and the router sends it nothing"
        )
        log.warning("Ignored foreign pod pdservice=%s/%s pod=%s reason=%s", meta.get("namespace"), meta["name"],
                    pod_meta["name"], held)  # fmt: skip
        events.append(post_event(api, body, "Warning", "ForeignPodIgnored", message, now=now))
    return events


# ------------------------------------------------------------------------------------------------------ 1. plan


def observe(
    pods: Iterable[dict[str, Any]],
    spec: EffectiveSpec,
    nodes: NodeLabels | None,
    services: Mapping[str, str] | None = None,
    router_control: RouterControl | None = None,
) -> Observed:
    """The cluster facts the render needs: per pool, the kv-compat values its pods carry (every pod the cache holds,
    terminating ones too: they still serve); the labels of the nodes they run on, only if the router's topology
    needs node labels (`nodes` None: none are read, as in tests without nodes); and the Services the PDService
    controls, by UID (`services`: what the router is told it may trust); the autoscaler's router control, passed
    through (`router_control`: the threshold it decided last)."""
    values: dict[EngineRole, set[str]] = {role: set() for role in ENGINE_ROLES}
    node_names: set[str] = set()
    for pod in pods:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        role = labels.get(ROLE_LABEL)
        if role not in ENGINE_ROLES:
            continue
        if labels.get(KV_COMPAT_LABEL):
            values[role].add(labels[KV_COMPAT_LABEL])
        if (pod.get("spec") or {}).get("nodeName"):
            node_names.add(pod["spec"]["nodeName"])
    node_labels = nodes.labels(node_names) if nodes is not None and node_topology_labels(spec) else {}
    return Observed(
        kv_compat={role: frozenset(found) for role, found in values.items()},
        node_labels=node_labels,
        services=dict(services or {}),
        router_control=router_control,
    )


def plan_writes(
    checked: Validated,
    snapshot: Snapshot,
    observed: Observed,
    owner_uid: str,
    found: Mapping[ObjectKey, dict[str, Any] | None] | None = None,
) -> planner.Plan:
    """The applies and prunes that bring the children of a valid PDService (owned by `owner_uid`) to what its
    spec renders to, given the children the cache holds (`snapshot`), the cluster facts the render reads, and what
    the API server holds under the names the cache lacks (`found`, from `look_up`)."""
    return plan_for(desired_children(checked, snapshot, observed), snapshot, owner_uid, found)


def desired_children(checked: Validated, snapshot: Snapshot, observed: Observed) -> list[dict[str, Any]]:
    """Every child the valid spec renders to, stamped, with the fields left to others adjusted (`plan.py`)."""
    return planner.desired_objects(checked.require()[1], render(checked, observed), snapshot.children)


def unknown_names(desired: Iterable[dict[str, Any]], snapshot: Snapshot) -> list[ObjectKey]:
    """The desired children the cache holds nothing under (owned or not): the names to look up before creating."""
    return [key for key in map(key_of, desired) if key not in snapshot.children and key not in snapshot.foreign]


def look_up(
    api: KubeIO, keys: Sequence[ObjectKey], pool: Executor | None
) -> tuple[dict[ObjectKey, dict[str, Any] | None], list[str]]:
    """What the API server holds under each name (None: free), read concurrently on `pool`; and the reads that
    failed (then no name is known to be free, and the pass writes nothing). The InferencePool (router mode
    gateway) is never in the cache (not watched: its CRD is optional), so it is read on every pass."""
    kinds = {kind.kind: kind for kind in (*MANAGED, INFERENCE_POOL)}

    def read(key: ObjectKey) -> tuple[ObjectKey, dict[str, Any] | None, str | None]:
        try:
            return key, api.read(kinds[key[0]], key[1], key[2]), None
        except ApiError as exc:
            return key, None, f"read {key[0]} {key[2]}: {exc}"

    found: dict[ObjectKey, dict[str, Any] | None] = {}
    failed: list[str] = []
    for key, obj, error in (pool.map if pool is not None else map)(read, keys):
        if error is not None:
            failed.append(error)
        else:
            found[key] = obj
    return found, failed


def plan_for(
    desired: Sequence[dict[str, Any]],
    snapshot: Snapshot,
    owner_uid: str,
    found: Mapping[ObjectKey, dict[str, Any] | None] | None = None,
) -> planner.Plan:
    """The plan over the cache's children and foreign objects plus what `look_up` found: an object found under a
    child's name is the child (observed, maybe drifted) when this PDService controls it, a conflict otherwise."""
    observed = dict(snapshot.children)
    foreign = dict(snapshot.foreign)
    for key, obj in (found or {}).items():
        if obj is not None:
            (observed if controlled_by(obj, owner_uid) else foreign)[key] = obj
    return planner.make_plan(desired, observed, owner_uid, foreign)


# ---------------------------------------------------------------------------------------------------- 3. status


def status_intent(
    body: Mapping[str, Any],
    checked: Validated,
    snapshot: Snapshot,
    *,
    report: ScalingReport | None,
    configured: bool,
) -> status_mod.Intent:
    """What the spec of the stored PDService `body` asks (`checked`: its validation result), as the values status
    reports (`status.Intent`); `body` gives only its name and the status it has now.

    A valid spec: each pool's desired replicas (an autoscaled pool's StatefulSet decides once it exists), the
    router's in-cluster URL, the kv-compat hash, and the autoscaler's view (`autoscaler.report.status_view`: its
    latest `report`, or why there is none; `configured`: whether the operator has a Prometheus at all). An invalid
    spec that parsed still says what the pools should have; the rest stays as the status said (the children and
    the autoscaler keep running the last valid spec). A spec that did not parse says nothing."""
    spec, old = checked.spec, body.get("status") or {}
    namespace, name = body["metadata"].get("namespace", "default"), body["metadata"]["name"]
    statefulsets = {role: snapshot.child("StatefulSet", namespace, child_name(name, role)) for role in ENGINE_ROLES}
    desired: dict[EngineRole, int | None] = {role: None for role in ENGINE_ROLES}
    if spec is not None:
        for role in ENGINE_ROLES:
            pool = spec.pool(role)
            # The autoscaler owns the replicas of an autoscaled pool: report what it asked for.
            desired[role] = (
                None if pool.autoscaling.enabled and statefulsets[role] is not None else pool.desired_replicas
            )
    fallback = spec.router.routing.fallback_to_decode if spec is not None else EffectiveRouting.fallback_to_decode
    if not checked.ok or checked.pds is None or spec is None:
        fields, conditions = kept_view(old)
        return status_mod.Intent(desired, fallback, None, None, fields, conditions)
    replicas = {role: _spec_replicas(sts) for role, sts in statefulsets.items()}
    fields, conditions = status_view(spec, replicas, configured=configured, report=report, old_status=old)
    store = kv_store_status(checked.pds, spec, snapshot.child("Deployment", namespace, child_name(name, "kvstore")))
    return status_mod.Intent(
        desired,
        fallback,
        router_endpoint(checked.pds, spec),
        kv_compat_hash(spec),
        fields,
        conditions,
        store,
        threshold_view(spec, report, old, configured=configured),
    )


def _spec_replicas(sts: Mapping[str, Any] | None) -> int | None:
    """A pool StatefulSet's spec.replicas (what its scaler asked for), None while it does not exist."""
    replicas = (sts or {}).get("spec", {}).get("replicas")
    return replicas if isinstance(replicas, int) else None


def transition_events(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """Events (type, reason, message) for the condition changes a user cares about: becoming (un)available, a new
    Degraded reason, recovering, the autoscaler going blind (metrics unavailable, no Prometheus configured) and
    seeing again."""
    events = []
    was, now = _condition(old, status_mod.AVAILABLE), _condition(new, status_mod.AVAILABLE)
    if was.get("status") != now.get("status"):
        if now.get("status") == "True":
            events.append(("Normal", "Available", now.get("message", "")))
        elif was:
            events.append(("Warning", "Unavailable", now.get("message", "")))
    was, now = _condition(old, status_mod.DEGRADED), _condition(new, status_mod.DEGRADED)
    if now.get("status") == "True" and (was.get("reason"), was.get("message")) != (now["reason"], now["message"]):
        events.append(("Warning", now["reason"], now.get("message", "")))
    elif now.get("status") == "False" and was.get("status") == "True":
        events.append(("Normal", "Recovered", f"no longer degraded (was {was.get('reason')})"))
    was, now = _condition(old, SCALING_ACTIVE), _condition(new, SCALING_ACTIVE)
    if now.get("status") == "False" and (was.get("status"), was.get("reason")) != ("False", now["reason"]):
        events.append(("Warning", now["reason"], f"autoscaling holds: {now.get('message', '')}"))
    elif now.get("status") == "True" and was.get("status") == "False":
        events.append(("Normal", "ScalingActive", f"autoscaling resumed (was {was.get('reason')})"))
    return events


def _condition(status: Mapping[str, Any] | None, type_: str) -> dict[str, Any]:
    for condition in (status or {}).get("conditions") or []:
        if condition.get("type") == type_:
            return dict(condition)
    return {}


def update_status(
    body: dict[str, Any],
    checked: Validated,
    done: Executed,
    outcome: Outcome,
    *,
    store: Store,
    api: KubeIO,
    now: Callable[[], str],
    crash_window: float,
    report: ScalingReport | None,
    configured: bool,
) -> None:
    """The status step: compute the status from the children as they are after the writes, write it when it
    changed, post the Events of its condition changes, and ask for a pass when it will change by itself."""
    meta = body["metadata"]
    snapshot, moment = store.snapshot(meta.get("namespace", "default"), meta["name"]), now()
    intent = status_intent(body, checked, snapshot, report=report, configured=configured)
    facts = status_mod.facts_of(body, snapshot, intent, moment, crash_window)
    new_status = status_mod.compute_status(
        body,
        facts,
        intent,
        problems=checked.problems,
        apply_errors=done.refused,
        conflicts=done.conflicts,
        applied=bool(done.applied or done.pruned),
        now=moment,
    )
    if checked.ok:
        outcome.requeue_after = status_mod.next_check_seconds(facts, moment)
        if done.conflicts:
            # The object in the way is seldom ours to watch (no pdserve labels): look again soon after its owner
            # may have removed it, rather than only at the next resync.
            outcome.requeue_after = min(outcome.requeue_after or CONFLICT_RECHECK_S, CONFLICT_RECHECK_S)
        pds, spec = checked.require()
        if spec.router.mode == "gateway":
            _report_inference_pool(api, pds, new_status, outcome)
    old_status = body.get("status")
    patch = status_mod.status_patch(old_status, new_status)
    if patch is None or not write_status(body, patch, store, api):
        return
    outcome.status_written = True
    if outcome.result == "noop":
        outcome.result = "status"
    for type_, reason, message in transition_events(old_status, new_status):
        outcome.events.append(post_event(api, body, type_, reason, message, now=now))


def _report_inference_pool(api: KubeIO, pds: PDService, new_status: dict[str, Any], outcome: Outcome) -> None:
    """status.inferencePool from the pool itself (read: the operator does not watch pools, their CRD is optional),
    and a pass again within `gateway_status.REFRESH_SECONDS` so that a gateway's verdict shows."""
    name = gateway_render.inference_pool_name(pds)
    try:
        pool = api.read(INFERENCE_POOL, pds.metadata.namespace, name)
    except ApiError as exc:
        log.warning("Failed to read InferencePool %s/%s error=%s", pds.metadata.namespace, name, exc)
        pool = None
    new_status["inferencePool"] = gateway_status.inference_pool_status(name, pool)
    refresh = gateway_status.REFRESH_SECONDS
    outcome.requeue_after = refresh if outcome.requeue_after is None else min(outcome.requeue_after, refresh)


def _log_rejected(body: Mapping[str, Any], checked: Validated) -> None:
    # checked.pds is None only when the document did not parse (the CRD should prevent that); the pydantic
    # problems are reported anyway.
    meta = body["metadata"]
    log.warning(
        "Rejected spec pdservice=%s/%s generation=%s problems=%s",
        meta.get("namespace"),
        meta["name"],
        meta.get("generation"),
        "; ".join(map(str, checked.problems)),
    )
