"""An in-memory informer cache: the latest version of every PDService and every child the operator watches.

kopf's watch streams feed it (one `on.event` handler per kind, filtered server-side by the managed-by label), and
the reconciler reads observed state from it instead of listing children on every pass. This is what makes a
reconcile cost zero API reads: the only requests it makes are writes, and a no-op reconcile makes none.

Staleness is safe by construction: an out-of-date entry can only cause an unnecessary (idempotent) apply or a
delayed prune, and the watch event that refreshes the entry also re-queues the owner for another pass. After an
apply the response replaces the entry at once, so the next pass sees what the API server stored.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from pdserve_operator.names import INSTANCE_LABEL, child_name
from pdserve_operator.observed import ObjectKey, OwnerKey, Snapshot, key_of
from pdserve_operator.ownership import controlled_by, is_service_slice, split_pods


def _version(value: str | None) -> int:
    # resourceVersions are opaque by contract but etcd revisions in practice; used only to drop an older copy that
    # arrives after a newer one (an apply response racing its own watch event) and to tell a relist's stale entries
    # from ones written after it. Unparseable -> -1 (always accepted, never judged stale by version).
    try:
        return int(value or -1)
    except ValueError:
        return -1


def _resource_version(obj: Mapping[str, Any]) -> int:
    return _version(obj.get("metadata", {}).get("resourceVersion"))


class Store:
    """Thread-safe: kopf handlers write from the event loop, reconciles read from worker threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owners: dict[OwnerKey, dict[str, Any]] = {}
        self._objects: dict[ObjectKey, dict[str, Any]] = {}
        self._by_owner: dict[OwnerKey, set[ObjectKey]] = defaultdict(set)

    # ---------------------------------------------------------------------------------------------------- owners

    def put_owner(self, body: dict[str, Any]) -> None:
        meta = body["metadata"]
        key = (meta.get("namespace", "default"), meta["name"])
        with self._lock:
            current = self._owners.get(key)
            if current is None or _resource_version(body) >= _resource_version(current):
                self._owners[key] = body

    def delete_owner(self, namespace: str, name: str) -> None:
        with self._lock:
            self._owners.pop((namespace, name), None)

    def owner(self, namespace: str, name: str) -> dict[str, Any] | None:
        with self._lock:
            return self._owners.get((namespace, name))

    def owners(self) -> list[tuple[OwnerKey, dict[str, Any]]]:
        """Every PDService, sorted by key (the bodies are the cache's own: read, never mutate)."""
        with self._lock:
            return sorted(self._owners.items(), key=lambda item: item[0])

    def owner_keys(self) -> list[OwnerKey]:
        with self._lock:
            return sorted(self._owners)

    # -------------------------------------------------------------------------------------------------- children

    @staticmethod
    def owner_of(obj: Mapping[str, Any]) -> OwnerKey | None:
        """The PDService an object belongs to, by its instance label (all our children and their pods carry it)."""
        meta = obj.get("metadata", {})
        instance = (meta.get("labels") or {}).get(INSTANCE_LABEL)
        if not instance:
            return None
        return (meta.get("namespace", "default"), instance)

    def put(self, obj: dict[str, Any]) -> OwnerKey | None:
        """Insert or refresh an object; returns its owner key (to enqueue), or None if it has none."""
        key = key_of(obj)
        owner = self.owner_of(obj)
        with self._lock:
            current = self._objects.get(key)
            if current is not None and _resource_version(obj) < _resource_version(current):
                return owner
            self._objects[key] = obj
            if current is not None:
                old_owner = self.owner_of(current)
                if old_owner is not None and old_owner != owner:
                    self._by_owner[old_owner].discard(key)
            if owner is not None:
                self._by_owner[owner].add(key)
        return owner

    def delete(self, obj: Mapping[str, Any]) -> OwnerKey | None:
        key = key_of(obj)
        with self._lock:
            current = self._objects.pop(key, None)
            owner = self.owner_of(current or obj)
            if owner is not None:
                self._by_owner[owner].discard(key)
        return owner

    def replace_kind(
        self,
        kind: str,
        namespaces: Collection[str] | None,
        objects: list[dict[str, Any]],
        listed_at: Iterable[str] = (),
    ) -> int:
        """Make the cache's objects of `kind` (in `namespaces`, or everywhere) exactly `objects`, a fresh list.

        This is an informer's relist: it drops entries whose DELETED event was never seen (kopf re-lists after a
        410 Gone without synthesising deletions), which would otherwise hide a missing child forever. An entry
        written after the lists' snapshots is kept (`listed_at`: the resourceVersion of each list `objects` came
        from, one per namespace; the oldest bounds it): its watch event arrived while a list was on its way, and
        dropping it would make a reconcile see an existing child as missing. Returns the number of stale entries
        dropped."""
        fresh = {key_of(obj): obj for obj in objects}
        snapshot = min((_version(version) for version in listed_at), default=-1)
        with self._lock:
            stale = [
                key
                for key, current in self._objects.items()
                if key[0] == kind
                and (namespaces is None or key[1] in namespaces)
                and key not in fresh
                and (snapshot < 0 or _resource_version(current) <= snapshot)
            ]
        for key in stale:
            self.delete({"kind": key[0], "metadata": {"namespace": key[1], "name": key[2]}})
        for obj in objects:
            self.put(obj)
        return len(stale)

    def snapshot(self, namespace: str, name: str) -> Snapshot:
        """Observed children, pods and router endpoint slices of one PDService, split into what it provably owns
        and what merely carries its labels (`ownership`; nothing is owned while the PDService itself is not in
        the cache). No copies: callers only read, and the store replaces whole objects rather than mutating them."""
        with self._lock:
            keys = list(self._by_owner.get((namespace, name), ()))
            objects = [self._objects[k] for k in keys if k in self._objects]
            owner = self._owners.get((namespace, name))
        uid = ((owner or {}).get("metadata") or {}).get("uid")
        children: dict[ObjectKey, dict[str, Any]] = {}
        foreign: dict[ObjectKey, dict[str, Any]] = {}
        for obj in objects:
            if obj["kind"] not in ("Pod", "EndpointSlice"):
                (children if controlled_by(obj, uid) else foreign)[key_of(obj)] = obj
        statefulsets = [children[key] for key in children if key[0] == "StatefulSet"]
        deployments = [key[2] for key in children if key[0] == "Deployment"]  # the router's, the KV store's
        pods = split_pods((o for o in objects if o["kind"] == "Pod"), statefulsets, deployments)
        router_service = children.get(("Service", namespace, child_name(name, "router")))
        slices = [o for o in objects if o["kind"] == "EndpointSlice" and is_service_slice(o, router_service)]
        return Snapshot(
            children=children, pods=pods.owned, endpoint_slices=slices, foreign=foreign, foreign_pods=pods.foreign
        )

    def size(self) -> int:
        with self._lock:
            return len(self._objects) + len(self._owners)
