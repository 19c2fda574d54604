"""What the operator observed of one PDService, as the informer cache hands it to the layers above.

The cache (`store`) fills a `Snapshot`; the pure layers read it (the planner compares the rendered objects with
its children, status summarises them, the autoscaler reads its pools' StatefulSets and pods). It lives at the
bottom so that none of them has to import another to share it.
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

    children: Mapping[ObjectKey, dict[str, Any]] = field(default_factory=dict)
    pods: Sequence[dict[str, Any]] = ()
    endpoint_slices: Sequence[dict[str, Any]] = ()

    def child(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.children.get((kind, namespace, name))
