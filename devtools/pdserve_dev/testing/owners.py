"""Owner references as Kubernetes' workload controllers write them, for tests that build observed objects by hand.

The operator counts a pod as a pool's only when the pool's StatefulSet controls it (`pdserve_operator.ownership`),
and a router pod only when a ReplicaSet of the router Deployment does; a test that feeds the informer cache pods
of its own making stamps them here, as the StatefulSet and ReplicaSet controllers would.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any


def controlled(obj: Mapping[str, Any], owner: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `obj` whose controller ownerReference is `owner` (its apiVersion, kind, name and UID)."""
    stamped = copy.deepcopy(dict(obj))
    meta = owner["metadata"]
    stamped.setdefault("metadata", {})["ownerReferences"] = [
        {
            "apiVersion": owner.get("apiVersion", "apps/v1"),
            "kind": owner["kind"],
            "name": meta["name"],
            "uid": meta["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    return stamped


def replica_set_pod(pod: Mapping[str, Any], deployment: str, template_hash: str = "5d9c7b") -> dict[str, Any]:
    """A copy of `pod` as a ReplicaSet of Deployment `deployment` makes it: controlled by `<deployment>-<hash>`
    and labelled with that `pod-template-hash`."""
    replica_set = {
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "metadata": {"name": f"{deployment}-{template_hash}", "uid": f"rs-{deployment}-{template_hash}"},
    }
    stamped = controlled(pod, replica_set)
    stamped["metadata"].setdefault("labels", {})["pod-template-hash"] = template_hash
    return stamped
