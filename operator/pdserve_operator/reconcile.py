"""The one reconcile path: observed PDService + children -> applies, prunes, status. Level-triggered.

It never asks why it runs (create, update, a child's event, a resync timer, a restart): it reads the latest state
from the informer cache, renders, plans, executes only the writes the plan contains, and writes status only when
it changed. Running it twice in a row makes no writes the second time.

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

The objects of one wave are applied concurrently on `applier`, the runner's thread pool (passed down, never a module
global); without one they are applied one after the other in the calling thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pdserve.api.defaults import EffectiveSpec
from pdserve.api.kvcompat import KV_COMPAT_LABEL
from pdserve.api.policy import DEFAULT_POLICY, Policy
from pdserve.api.v1alpha1 import PDService
from pdserve.api.validation import Validated, validate
from pdserve_operator import gateway_status
from pdserve_operator import plan as planner
from pdserve_operator import status as status_mod
from pdserve_operator.autoscaler.report import SCALING_ACTIVE, ScalingBoard
from pdserve_operator.kinds import INFERENCE_POOL
from pdserve_operator.kube import ApiError, KubeIO
from pdserve_operator.nodes import NodeLabels
from pdserve_operator.render import Observed, render
from pdserve_operator.render import gateway as gateway_render
from pdserve_operator.render.discovery import node_topology_labels
from pdserve_operator.render.names import ENGINE_ROLES, ROLE_LABEL, EngineRole
from pdserve_operator.store import Store

log = logging.getLogger("pdserve.operator.reconcile")


class RetryLaterError(Exception):
    """A transient failure: the work queue retries this PDService with backoff."""


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


def _apply_one(api: KubeIO, item: planner.Apply) -> tuple[planner.Apply, dict[str, Any] | None, ApiError | None]:
    try:
        return item, api.apply(item.obj), None
    except ApiError as exc:
        return item, None, exc


def observe(pods: Iterable[dict[str, Any]], spec: EffectiveSpec, nodes: NodeLabels | None) -> Observed:
    """The cluster facts the render needs: per pool, the kv-compat values its pods carry (every pod the cache holds,
    terminating ones too: they still serve); and the labels of the nodes they run on, only if the router's topology
    needs node labels (`nodes` None: none are read, as in tests without nodes)."""
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
    return Observed(kv_compat={role: frozenset(found) for role, found in values.items()}, node_labels=node_labels)


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _spec_document(body: dict[str, Any]) -> dict[str, Any]:
    # Validation and the models see what the user wrote; status is ours and kopf-free.
    return {key: value for key, value in body.items() if key != "status"}


def _condition(status: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for condition in (status or {}).get("conditions") or []:
        if condition.get("type") == type_:
            return dict(condition)
    return {}


def _transition_events(old: dict[str, Any] | None, new: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Events for condition changes a user cares about: becoming (un)available, a new Degraded reason."""
    events = []
    was, now = _condition(old, "Available"), _condition(new, "Available")
    if was.get("status") != now.get("status"):
        if now.get("status") == "True":
            events.append(("Normal", "Available", now.get("message", "")))
        elif was:
            events.append(("Warning", "Unavailable", now.get("message", "")))
    was, now = _condition(old, "Degraded"), _condition(new, "Degraded")
    if now.get("status") == "True" and (was.get("reason"), was.get("message")) != (now["reason"], now["message"]):
        events.append(("Warning", now["reason"], now.get("message", "")))
    elif now.get("status") == "False" and was.get("status") == "True":
        events.append(("Normal", "Recovered", f"no longer degraded (was {was.get('reason')})"))
    # The autoscaler going blind (metrics unavailable, no Prometheus configured) and seeing again.
    was, now = _condition(old, SCALING_ACTIVE), _condition(new, SCALING_ACTIVE)
    if now.get("status") == "False" and (was.get("status"), was.get("reason")) != ("False", now["reason"]):
        events.append(("Warning", now["reason"], f"autoscaling holds: {now.get('message', '')}"))
    elif now.get("status") == "True" and was.get("status") == "False":
        events.append(("Normal", "ScalingActive", f"autoscaling resumed (was {was.get('reason')})"))
    return events


def reconcile(
    namespace: str,
    name: str,
    store: Store,
    api: KubeIO,
    now: Callable[[], str] = utc_now,
    *,
    applier: Executor | None = None,
    policy: Policy = DEFAULT_POLICY,
    crash_window: float = status_mod.CRASH_RECOVERY_SECONDS,
    scaling: ScalingBoard | None = None,
    nodes: NodeLabels | None = None,
) -> Outcome:
    """One pass for one PDService. Raises RetryLaterError (transient failure) or NotLeaderError (leadership lost).

    `policy` is the administrator's (the operator's flags, e.g. which node paths may hold model weights).
    `crash_window`: how long a crashed container must be running and ready again before it stops counting
    (`status.CRASH_RECOVERY_SECONDS`). `scaling`: the autoscaler loops' reports, placed in status as they are
    (None: an operator without an autoscaler, like one started without --prometheus-url). `nodes`: where node labels
    come from (`nodes.NodeLabelCache`); None reads none (the topology ConfigMap then lists no node)."""
    body = store.owner(namespace, name)
    if body is None:
        return Outcome("gone")  # deleted: ownerReferences garbage-collect the children
    if body["metadata"].get("deletionTimestamp"):
        return Outcome("gone")
    # Parsed and checked once: the result carries the model and its effective spec to render and status.
    checked = validate(_spec_document(body), policy)
    if not checked.ok:
        return _invalid(body=body, checked=checked, store=store, api=api, now=now, crash_window=crash_window)

    pds, spec = checked.require()
    uid = body["metadata"]["uid"]
    snapshot = store.snapshot(namespace, name)
    rendered = render(checked, observe(snapshot.pods, spec, nodes))
    desired = planner.desired_objects(pds, rendered, snapshot.children)
    the_plan = planner.make_plan(desired, snapshot.children, uid)

    outcome = Outcome("noop" if the_plan.empty else "applied")
    apply_errors: list[str] = []
    transient: list[str] = []
    done: dict[str, list[str]] = {}
    apply_all = applier.map if applier is not None else map
    for wave in the_plan.waves():
        # Objects of one wave are independent: apply them concurrently (a NotLeaderError propagates from map).
        for item, response, error in apply_all(lambda it: _apply_one(api, it), wave):
            label = f"{item.kind.kind} {item.obj['metadata']['name']}"
            if error is not None:
                (transient if error.retriable else apply_errors).append(f"{label}: {error}")
                log.warning("Failed to apply %s pdservice=%s/%s error=%s", label, namespace, name, error)
                continue
            assert response is not None
            store.put(response)
            outcome.applied.append(f"{label} ({item.reason})")
            verb = {"missing": "Created", "changed": "Updated"}.get(item.reason, "Reverted drift of")
            done.setdefault(verb, []).append(label if verb != "Reverted drift of" else f"{label} ({item.reason})")
            log.info("%s %s pdservice=%s/%s reason=%s", verb, label, namespace, name, item.reason)
    for verb, labels in done.items():
        # One event per pass and verb, not per object: events are API writes too.
        _event(api, body, "Normal", "Applied", f"{verb} {', '.join(labels)}", now=now, outcome=outcome)
    for prune in the_plan.prunes:
        label = f"{prune.kind.kind} {prune.name}"
        try:
            api.delete(prune.kind, prune.namespace, prune.name, prune.uid)
        except ApiError as exc:
            (transient if exc.retriable else apply_errors).append(f"delete {label}: {exc}")
            continue
        store.delete({"kind": prune.kind.kind, "metadata": {"namespace": prune.namespace, "name": prune.name}})
        outcome.pruned.append(label)
        log.info("Pruned %s pdservice=%s/%s", label, namespace, name)
    if outcome.pruned:
        message = f"Deleted {', '.join(outcome.pruned)}: the spec no longer produces them"
        _event(api, body, "Normal", "Pruned", message, now=now, outcome=outcome)
    # Refused applies become Degraded/ApplyFailed; its Warning event is posted when the condition changes (below),
    # not on every pass, so a persistent refusal does not flood the namespace with events.

    observed, moment = store.snapshot(namespace, name), now()
    new_status = status_mod.compute_status(
        body,
        observed,
        pds=pds,
        apply_errors=apply_errors,
        applied=bool(outcome.applied or outcome.pruned),
        now=moment,
        crash_window=crash_window,
        scaling=scaling.get((namespace, name)) if scaling is not None else None,
        scaling_configured=scaling is not None and scaling.configured,
    )
    outcome.requeue_after = status_mod.next_check_seconds(observed, moment, crash_window)
    if spec.router.mode == "gateway":
        _report_inference_pool(api, pds, new_status, outcome)
    _write_status(body=body, new_status=new_status, store=store, api=api, now=now, outcome=outcome)
    if transient:
        raise RetryLaterError("; ".join(transient))
    return outcome


def _report_inference_pool(api: KubeIO, pds: PDService, new_status: dict[str, Any], outcome: Outcome) -> None:
    """status.inferencePool from the pool itself (read: the operator does not watch pools, their CRD is optional)."""
    name = gateway_render.inference_pool_name(pds)
    try:
        pool = api.read(INFERENCE_POOL, pds.metadata.namespace, name)
    except ApiError as exc:
        log.warning("Failed to read InferencePool %s/%s error=%s", pds.metadata.namespace, name, exc)
        pool = None
    new_status["inferencePool"] = gateway_status.inference_pool_status(name, pool)
    refresh = gateway_status.REFRESH_SECONDS
    outcome.requeue_after = refresh if outcome.requeue_after is None else min(outcome.requeue_after, refresh)


def _invalid(
    *,
    body: dict[str, Any],
    checked: Validated,
    store: Store,
    api: KubeIO,
    now: Callable[[], str],
    crash_window: float,
) -> Outcome:
    meta = body["metadata"]
    problems = checked.problems
    # checked.pds is None only when the document did not parse (the CRD should prevent that); the pydantic
    # problems are reported anyway.
    log.warning(
        "Rejected spec pdservice=%s/%s generation=%s problems=%s",
        meta.get("namespace"),
        meta["name"],
        meta.get("generation"),
        "; ".join(map(str, problems)),
    )
    snapshot, moment = store.snapshot(meta.get("namespace", "default"), meta["name"]), now()
    new_status = status_mod.compute_status(
        body, snapshot, pds=checked.pds, problems=problems, now=moment, crash_window=crash_window
    )
    outcome = Outcome("invalid")
    _write_status(body=body, new_status=new_status, store=store, api=api, now=now, outcome=outcome)
    return outcome


def _event(
    api: KubeIO,
    body: dict[str, Any],
    type_: str,
    reason: str,
    message: str,
    *,
    now: Callable[[], str],
    outcome: Outcome,
) -> None:
    api.post_event(body, type_, reason, message, now())
    outcome.events.append(f"{type_} {reason}: {message}")


def _write_status(
    *,
    body: dict[str, Any],
    new_status: dict[str, Any],
    store: Store,
    api: KubeIO,
    now: Callable[[], str],
    outcome: Outcome,
) -> None:
    old_status = body.get("status")
    patch = status_mod.status_patch(old_status, new_status)
    if patch is None:
        return
    meta = body["metadata"]
    try:
        updated = api.patch_status(meta.get("namespace", "default"), meta["name"], patch)
    except ApiError as exc:
        if exc.not_found:
            return  # deleted meanwhile
        raise RetryLaterError(f"status: {exc}") from exc
    store.put_owner(updated)
    outcome.status_written = True
    if outcome.result == "noop":
        outcome.result = "status"
    for type_, reason, message in _transition_events(old_status, new_status):
        _event(api, body, type_, reason, message, now=now, outcome=outcome)
