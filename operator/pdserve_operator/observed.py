"""What the operator observed of one PDService, as the informer cache hands it to the layers above.

The cache (`store`) fills a `Snapshot`; the pure layers read it (the planner compares the rendered objects with
its children, status summarises them, the autoscaler reads its pools' StatefulSets and pods). It lives at the
bottom so that none of them has to import another to share it.

A snapshot holds only what the PDService provably owns (`ownership`: controller references and UIDs) in
`children`, `pods` and `endpoint_slices`; objects that merely carry its labels are kept apart in `foreign` and
`foreign_pods`, for the planner (which refuses to take over an object of a child's name) and for reports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

ObjectKey = tuple[str, str, str]  # (kind, namespace, name)
OwnerKey = tuple[str, str]  # (namespace, PDService name)


def key_of(obj: Mapping[str, Any]) -> ObjectKey:
    """The cache key of an object: (kind, namespace, name)."""
    meta = obj["metadata"]
    return (obj["kind"], meta.get("namespace", ""), meta["name"])


@dataclass
class Snapshot:
    """What the operator observed of one PDService's children."""

    #: Children controlled by the PDService (its UID in their controller reference).
    children: Mapping[ObjectKey, dict[str, Any]] = field(default_factory=dict)
    #: Pods of its pool StatefulSets and of its router Deployment.
    pods: Sequence[dict[str, Any]] = ()
    #: Its router Service's EndpointSlices, as the EndpointSlice controller made them.
    endpoint_slices: Sequence[dict[str, Any]] = ()
    #: Objects of the managed kinds that carry its labels but are not controlled by it.
    foreign: Mapping[ObjectKey, dict[str, Any]] = field(default_factory=dict)
    #: Pods that carry its labels but are not its workloads' (never counted, reported once).
    foreign_pods: Sequence[dict[str, Any]] = ()

    def child(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.children.get((kind, namespace, name))

    def uids(self, kind: str) -> dict[str, str]:
        """Name -> UID of the children of one kind (what the router is told it may trust: `render.discovery`)."""
        return {
            key[2]: str(obj["metadata"]["uid"])
            for key, obj in self.children.items()
            if key[0] == kind and (obj.get("metadata") or {}).get("uid")
        }
