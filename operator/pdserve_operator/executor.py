"""The IO executor of one reconcile pass: the planner's writes, Events and the status patch, nothing decided here.

`plan.py` decides which objects to apply and which to prune, `status.py` what the status says; this module makes
those writes through `kube.KubeIO` (the API server) and keeps the informer cache (`store.Store`) in step with what
the server answered, so that the next pass sees its own writes before their watch events arrive. It is lws'
executor.go to plan.py's planner.go.

- Applies run wave by wave (`Plan.waves`: config and RBAC before the workloads that use them); the objects of one
  wave are independent and go out concurrently on `applier`, the runner's thread pool (passed down, never a module
  global), or one after the other in the calling thread without one.
- A refused write never stops the pass: it is collected, as `refused` (the API server said no: the status reports
  it) or `transient` (connection, 5xx, 409, 429: the pass is retried with backoff), and the other writes go on.
- A plan with conflicts (names held by other owners, `plan.Conflict`) makes no write: they are collected as
  `conflicts` (status: Degraded/ChildConflict), except names held by a deleted predecessor of the same name, which
  the garbage collector frees by itself (`transient`: retried with backoff).
- Leadership lost (`NotLeaderError` from any write) propagates at once: no further write is made.
- One Event per pass and verb ("Created ...", "Updated ...", "Deleted ..."), not per object: Events are API
  writes too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from pdserve_operator.kube import ApiError, KubeIO
from pdserve_operator.plan import Apply, Plan
from pdserve_operator.store import Store

log = logging.getLogger("pdserve.operator.reconcile")


class RetryLaterError(Exception):
    """A transient failure: the work queue retries this PDService with backoff."""


@dataclass
class Executed:
    """What executing one plan did: the writes that went through, the Events posted, the writes refused."""

    applied: list[str] = field(default_factory=list)  # "Kind name (reason)"
    pruned: list[str] = field(default_factory=list)  # "Kind name"
    events: list[str] = field(default_factory=list)  # "Type Reason: message"
    refused: list[str] = field(default_factory=list)  # refused for good (4xx): Degraded/ApplyFailed
    transient: list[str] = field(default_factory=list)  # worth a retry with backoff
    conflicts: list[str] = field(default_factory=list)  # names held by other owners: Degraded/ChildConflict


def post_event(
    api: KubeIO, body: dict[str, Any], type_: str, reason: str, message: str, *, now: Callable[[], str]
) -> str:
    """Post an Event about the PDService; returns it as "Type Reason: message" (for the pass's outcome)."""
    api.post_event(body, type_, reason, message, now())
    return f"{type_} {reason}: {message}"


def _apply_one(api: KubeIO, item: Apply) -> tuple[Apply, dict[str, Any] | None, ApiError | None]:
    try:
        return item, api.apply(item.obj), None
    except ApiError as exc:
        return item, None, exc


def execute(
    plan: Plan,
    body: dict[str, Any],
    store: Store,
    api: KubeIO,
    *,
    applier: Executor | None,
    now: Callable[[], str],
) -> Executed:
    """Apply and prune what `plan` says for the PDService `body`, post the Events that say so, and put every answer
    into the cache. Raises only `NotLeaderError`; every refused write is in the result."""
    meta = body["metadata"]
    namespace, name = meta.get("namespace", "default"), meta["name"]
    done = Executed()
    for conflict in plan.conflicts:
        text = conflict.describe()
        if conflict.holder.predecessor:
            done.transient.append(f"waiting for the garbage collector to delete {text}")
        else:
            done.conflicts.append(text)
        log.warning("Refused to take over a child pdservice=%s/%s conflict=%s", namespace, name, text)
    verbs: dict[str, list[str]] = {}
    apply_all = applier.map if applier is not None else map
    for wave in plan.waves():
        # Objects of one wave are independent: apply them concurrently (a NotLeaderError propagates from map).
        for item, response, error in apply_all(lambda it: _apply_one(api, it), wave):
            label = f"{item.kind.kind} {item.obj['metadata']['name']}"
            if error is not None:
                (done.transient if error.retriable else done.refused).append(f"{label}: {error}")
                log.warning("Failed to apply %s pdservice=%s/%s error=%s", label, namespace, name, error)
                continue
            assert response is not None
            store.put(response)
            done.applied.append(f"{label} ({item.reason})")
            verb = {"missing": "Created", "changed": "Updated"}.get(item.reason, "Reverted drift of")
            verbs.setdefault(verb, []).append(label if verb != "Reverted drift of" else f"{label} ({item.reason})")
            log.info("%s %s pdservice=%s/%s reason=%s", verb, label, namespace, name, item.reason)
    for verb, labels in verbs.items():
        done.events.append(post_event(api, body, "Normal", "Applied", f"{verb} {', '.join(labels)}", now=now))
    for prune in plan.prunes:
        label = f"{prune.kind.kind} {prune.name}"
        try:
            api.delete(prune.kind, prune.namespace, prune.name, prune.uid)
        except ApiError as exc:
            (done.transient if exc.retriable else done.refused).append(f"delete {label}: {exc}")
            continue
        store.delete({"kind": prune.kind.kind, "metadata": {"namespace": prune.namespace, "name": prune.name}})
        done.pruned.append(label)
        log.info("Pruned %s pdservice=%s/%s", label, namespace, name)
    if done.pruned:
        message = f"Deleted {', '.join(done.pruned)}: the spec no longer produces them"
        done.events.append(post_event(api, body, "Normal", "Pruned", message, now=now))
    # Refused applies become Degraded/ApplyFailed; its Warning event is posted when the condition changes (the
    # reconcile's status step), not on every pass, so a persistent refusal does not flood the namespace with events.
    return done


def write_status(body: Mapping[str, Any], patch: dict[str, Any], store: Store, api: KubeIO) -> bool:
    """Patch the PDService's status (a JSON merge patch) and put the answer into the cache. False when the
    PDService was deleted meanwhile; `RetryLaterError` when the write failed otherwise."""
    meta = body["metadata"]
    try:
        updated = api.patch_status(meta.get("namespace", "default"), meta["name"], patch)
    except ApiError as exc:
        if exc.not_found:
            return False  # deleted meanwhile
        raise RetryLaterError(f"status: {exc}") from exc
    store.put_owner(updated)
    return True
