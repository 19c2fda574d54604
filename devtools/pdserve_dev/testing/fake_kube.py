"""FakeKube: an in-memory fake of the operator's Kubernetes IO layer (`pdserve_operator.kube.KubeIO`).

This is a fake of the *IO layer*, not a mock of the API server: it implements the writes a reconcile makes
(apply, delete, status patch, event) and the autoscaler's (a /scale write) over a dict of objects, so the
reconcile and autoscaler-loop unit tests can drive the failure contract scenario by scenario (kube-rs style)
without a cluster. What it keeps of `KubeApi`'s contract:

- every write first asks the leader guard and raises `NotLeaderError` without writing once leadership is gone;
  `post_event` swallows both `NotLeaderError` and `ApiError` (events are advisory), as `KubeApi` does;
- failures are `ApiError(code, message, reason)`, with code 0 for a connection failure;
- apply returns the stored object with server-set metadata (uid, resourceVersion, generation bumped when the
  spec changes) and refuses with 409 an object whose `metadata.resourceVersion` is set and stale (the optimistic
  lock the planner relies on), status patch merge-patches the PDService's `.status` and returns the whole object,
  scale sets a stored object's `spec.replicas` and returns a Scale.
- `node` (a read, `nodes.NodeReader`) answers from `nodes` and counts each read in `node_reads`; a missing
  node is a 404, and `fail("node", code)` makes reads fail like writes.
- `read` (whether a child's name is free) answers from the stored objects (None when absent) and records each read
  in `reads`; `fail("read", code)` makes it fail. `add_object` stores an object another user created.

What it does not model (the API server's validation, defaulting, field ownership, admission, watches) is what the
cluster tests cover against the real kube-apiserver. Every write attempt is recorded in `calls`, in order, with
its outcome, so a test can assert what was written, what was refused, and that nothing came after.
"""

from __future__ import annotations

import copy
import itertools
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdserve_operator.kinds import PDSERVICE, Kind
from pdserve_operator.kube import ApiError, NotLeaderError
from pdserve_operator.observed import ObjectKey

_REASONS = {0: "ConnectionError", 409: "Conflict", 422: "Invalid", 429: "TooManyRequests", 500: "InternalError"}


@dataclass(frozen=True)
class Call:
    """One write attempt: `verb` (apply, delete, status, event), its target and how it ended."""

    verb: str
    kind: str
    name: str
    outcome: str  # ok | not-leader | HTTP code as text ("422", "0" for a connection failure)

    @property
    def written(self) -> bool:
        return self.outcome == "ok"


@dataclass
class Failure:
    """Answer writes matching `verb` (and `kind`/`name` when set) with `code`; `times` None means for ever."""

    verb: str
    code: int
    message: str
    kind: str | None = None
    name: str | None = None
    times: int | None = None

    def matches(self, verb: str, kind: str, name: str) -> bool:
        return (
            self.verb == verb
            and self.kind in (None, kind)
            and self.name in (None, name)
            and (self.times is None or self.times > 0)
        )


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: maps merge recursively, null deletes, anything else replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


class FakeKube:
    """Thread-safe (a reconcile applies one wave's objects concurrently)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._versions = itertools.count(1000)
        self._uids = itertools.count(1)
        self.objects: dict[ObjectKey, dict[str, Any]] = {}
        self.calls: list[Call] = []
        self.events: list[dict[str, Any]] = []
        self.failures: list[Failure] = []
        self.leader = True
        self._writes_left: int | None = None  # leadership ends after this many more successful writes
        self.nodes: dict[str, dict[str, Any]] = {}
        self.node_reads: list[str] = []
        self.reads: list[str] = []

    # ------------------------------------------------------------------------------------------- test controls

    def add_owner(self, body: dict[str, Any]) -> dict[str, Any]:
        """Store a PDService as the API server would (uid, resourceVersion, generation) and return it."""
        stored = copy.deepcopy(body)
        meta = stored.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        with self._lock:
            previous = self.objects.get(_key(stored))
            # An update keeps the object's UID, as the API server does; only a new object gets one.
            meta.setdefault("uid", previous["metadata"]["uid"] if previous else f"uid-{next(self._uids)}")
            meta["resourceVersion"] = str(next(self._versions))
            meta["generation"] = _next_generation(previous, stored)
            if previous is not None and "status" in previous:
                stored["status"] = previous["status"]
            self.objects[_key(stored)] = stored
        return copy.deepcopy(stored)

    def add_object(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Store an object as another user's create would (uid, resourceVersion), not as an apply of ours."""
        stored = copy.deepcopy(obj)
        meta = stored.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        with self._lock:
            meta.setdefault("uid", f"uid-{next(self._uids)}")
            meta["resourceVersion"] = str(next(self._versions))
            self.objects[_key(stored)] = stored
        return copy.deepcopy(stored)

    def owner(self, namespace: str, name: str) -> dict[str, Any]:
        with self._lock:
            return copy.deepcopy(self.objects[(PDSERVICE.kind, namespace, name)])

    def fail(
        self,
        verb: str,
        code: int,
        message: str = "",
        *,
        kind: str | None = None,
        name: str | None = None,
        times: int | None = None,
    ) -> Failure:
        failure = Failure(verb, code, message or f"injected {code}", kind, name, times)
        self.failures.append(failure)
        return failure

    def lose_leadership_after(self, writes: int) -> None:
        """Stay the leader for `writes` more successful writes, then lose the Lease (every later write refused)."""
        self._writes_left = writes

    def finish_rollouts(self) -> list[dict[str, Any]]:
        """Play the StatefulSet and Deployment controllers: every workload fully rolled out and ready. Returns the
        updated objects, which a test feeds to the informer cache as their watch events would."""
        changed = []
        with self._lock:
            for key, obj in self.objects.items():
                if key[0] not in ("StatefulSet", "Deployment"):
                    continue
                replicas = int(obj.get("spec", {}).get("replicas", 1))
                obj["status"] = {
                    "observedGeneration": obj["metadata"]["generation"],
                    "replicas": replicas,
                    "readyReplicas": replicas,
                    "updatedReplicas": replicas,
                    "availableReplicas": replicas,
                    "currentRevision": "r1",
                    "updateRevision": "r1",
                }
                obj["metadata"]["resourceVersion"] = str(next(self._versions))
                changed.append(copy.deepcopy(obj))
        return changed

    def written(self) -> list[Call]:
        return [call for call in self.calls if call.written]

    def mark(self) -> int:
        """The index of the next call: `calls_since(mark)` lists what one pass did."""
        return len(self.calls)

    def calls_since(self, mark: int) -> list[Call]:
        return self.calls[mark:]

    # ------------------------------------------------------------------------------------------------ KubeIO

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        with self._lock:
            self._begin("apply", obj["kind"], meta["name"])
            key = _key(obj)
            previous = self.objects.get(key)
            precondition = meta.get("resourceVersion")
            if precondition and previous is not None and previous["metadata"]["resourceVersion"] != precondition:
                self.calls[-1] = Call("apply", obj["kind"], meta["name"], "409")
                raise ApiError(409, "the object has been modified; please apply your changes to the latest version")
            stored = copy.deepcopy(obj)
            stored_meta = stored["metadata"]
            stored_meta["uid"] = previous["metadata"]["uid"] if previous else f"uid-{next(self._uids)}"
            stored_meta["resourceVersion"] = str(next(self._versions))
            stored_meta["generation"] = _next_generation(previous, stored)
            if previous is not None and "status" in previous:
                stored["status"] = previous["status"]
            self.objects[key] = stored
            return copy.deepcopy(stored)

    def delete(self, kind: Kind, namespace: str, name: str, uid: str) -> None:
        with self._lock:
            self._begin("delete", kind.kind, name)
            current = self.objects.get((kind.kind, namespace, name))
            if current is not None and current["metadata"].get("uid") == uid:
                del self.objects[(kind.kind, namespace, name)]

    def patch_status(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self._begin("status", PDSERVICE.kind, name)
            key = (PDSERVICE.kind, namespace, name)
            if key not in self.objects:
                self.calls[-1] = Call("status", PDSERVICE.kind, name, "404")
                raise ApiError(404, f'pdservices "{name}" not found', "NotFound")
            current = self.objects[key]
            current["status"] = merge_patch(current.get("status") or {}, patch)
            current["metadata"]["resourceVersion"] = str(next(self._versions))
            return copy.deepcopy(current)

    def scale(self, kind: Kind, namespace: str, name: str, replicas: int) -> dict[str, Any]:
        with self._lock:
            self._begin("scale", kind.kind, name)
            current = self.objects.get((kind.kind, namespace, name))
            if current is None:
                self.calls[-1] = Call("scale", kind.kind, name, "404")
                raise ApiError(404, f'{kind.plural} "{name}" not found', "NotFound")
            before = copy.deepcopy(current)
            current.setdefault("spec", {})["replicas"] = replicas
            current["metadata"]["resourceVersion"] = str(next(self._versions))
            current["metadata"]["generation"] = _next_generation(before, current)
            return {
                "apiVersion": "autoscaling/v1",
                "kind": "Scale",
                "metadata": {k: current["metadata"].get(k) for k in ("name", "namespace", "uid", "resourceVersion")},
                "spec": {"replicas": replicas},
                "status": {"replicas": int((current.get("status") or {}).get("replicas", 0))},
            }

    def set_replicas(self, kind: str, namespace: str, name: str, replicas: int) -> dict[str, Any]:
        """Another writer (HPA, `kubectl scale`) sets an object's replicas; returns the object for the cache."""
        with self._lock:
            current = self.objects[(kind, namespace, name)]
            before = copy.deepcopy(current)
            current["spec"]["replicas"] = replicas
            current["metadata"]["resourceVersion"] = str(next(self._versions))
            current["metadata"]["generation"] = _next_generation(before, current)
            return copy.deepcopy(current)

    def post_event(self, involved: dict[str, Any], type_: str, reason: str, message: str, now: str) -> None:
        with self._lock:
            try:
                self._begin("event", "Event", involved["metadata"]["name"])
            except (ApiError, NotLeaderError):
                return  # events are advisory: KubeApi logs and carries on
            self.events.append({"type": type_, "reason": reason, "message": message, "time": now})

    # ------------------------------------------------------------------------------------------------- reads

    def read(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        """A GET (reads need no leadership); None when the object does not exist."""
        with self._lock:
            self.reads.append(f"{kind.kind} {name}")
            for failure in self.failures:
                if failure.matches("read", kind.kind, name):
                    if failure.times is not None:
                        failure.times -= 1
                    raise ApiError(failure.code, failure.message, _REASONS.get(failure.code, "Error"))
            found = self.objects.get((kind.kind, namespace, name))
            return copy.deepcopy(found) if found is not None else None

    def add_node(self, name: str, labels: dict[str, str]) -> None:
        with self._lock:
            self.nodes[name] = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}}

    def node(self, name: str) -> dict[str, Any]:
        with self._lock:
            self.node_reads.append(name)
            for failure in self.failures:
                if failure.matches("node", "Node", name):
                    if failure.times is not None:
                        failure.times -= 1
                    raise ApiError(failure.code, failure.message, _REASONS.get(failure.code, "Error"))
            if name not in self.nodes:
                raise ApiError(404, f'nodes "{name}" not found', "NotFound")
            return copy.deepcopy(self.nodes[name])

    # ------------------------------------------------------------------------------------------------ plumbing

    def _begin(self, verb: str, kind: str, name: str) -> None:
        """The leader guard, then injected failures; records the attempt either way. Called under the lock."""
        if self._writes_left is not None and self._writes_left <= 0:
            self.leader = False
        if not self.leader:
            self.calls.append(Call(verb, kind, name, "not-leader"))
            raise NotLeaderError(f"not the leader; refusing to {verb} {kind}")
        for failure in self.failures:
            if failure.matches(verb, kind, name):
                if failure.times is not None:
                    failure.times -= 1
                self.calls.append(Call(verb, kind, name, str(failure.code)))
                raise ApiError(failure.code, failure.message, _REASONS.get(failure.code, "Error"))
        self.calls.append(Call(verb, kind, name, "ok"))
        if self._writes_left is not None:
            self._writes_left -= 1


def _key(obj: Mapping[str, Any]) -> ObjectKey:
    meta = obj["metadata"]
    return (obj["kind"], meta.get("namespace", "default"), meta["name"])


def _next_generation(previous: Mapping[str, Any] | None, new: Mapping[str, Any]) -> int:
    # Like the API server: generation starts at 1 and moves only when the spec (not metadata or status) changes.
    if previous is None:
        return 1
    generation = int(previous["metadata"].get("generation", 1))
    return generation + 1 if previous.get("spec") != new.get("spec") else generation
