"""Metadata shared by every rendered object: name, namespace, labels and the controller ownerReference."""

from __future__ import annotations

from typing import Any

from pdserve.api.v1alpha1 import API_VERSION, KIND, PDService
from pdserve_operator.names import Role, labels


def owner_reference(pds: PDService) -> dict[str, Any] | None:
    """The controller ownerReference, when the PDService has a UID (it does once it is stored)."""
    if pds.metadata.uid is None:
        return None
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": pds.metadata.name,
        "uid": pds.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def metadata(pds: PDService, name: str, role: Role) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": pds.metadata.namespace, "labels": labels(pds, role)}
    owner = owner_reference(pds)
    if owner is not None:
        meta["ownerReferences"] = [owner]
    return meta
