"""Which EndpointSlices and endpoints the router may send prompts to (pure): proven ownership, never labels.

The pools' label selectors find slices by labels, and labels are not proof: anyone with `edit` in the namespace
may create a Service carrying a pool's labels (the EndpointSlice controller then makes its slices like any other
and copies the labels onto them), or a pod carrying them (which the operator's own Services then select). So of
the slices a selector finds, the router keeps (`pdserve.api.router_config` states the contract):

1. only slices the EndpointSlice controller made (its `managed-by` label: the controller sets and overwrites it,
   and `edit` may not write EndpointSlices at all);
2. of a Service the operator owns: the slice's `kubernetes.io/service-name` (also the controller's) is listed in
   the operator's published `OwnedServices`, and the slice's controller reference carries that Service's UID (a
   Service someone else made under that name, say right after deleting the operator's, has another UID);
3. and of those slices, only endpoints whose pod is named as a member of the pool's StatefulSet
   (`<statefulset>-<ordinal>`): the StatefulSet controller releases a pod claiming it under another name and
   deletes one beyond its replicas, and names are unique in a namespace.

Until the published list has been read (`owned` None) nothing is trusted: the pools stay empty rather than
unproven. A configuration without a published list (hand-written, `discoveryConfigMap` unset) skips 1 and 2.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve.api.router_config import (
    ENDPOINT_SLICE_CONTROLLER,
    MANAGED_BY_SLICE_LABEL,
    SERVICE_NAME_LABEL,
    is_member_pod,
)

__all__ = ["Trusted", "trusted_slices", "why_untrusted"]


def why_untrusted(slice_obj: Mapping[str, Any], owned: Mapping[str, str]) -> str | None:
    """Why rules 1 and 2 reject a slice (made by the EndpointSlice controller for a Service in `owned`, name ->
    UID, by UID), or None when they hold."""
    meta = slice_obj.get("metadata") or {}
    labels = meta.get("labels") or {}
    if labels.get(MANAGED_BY_SLICE_LABEL) != ENDPOINT_SLICE_CONTROLLER:
        return "not made by the EndpointSlice controller"
    service = str(labels.get(SERVICE_NAME_LABEL) or "")
    uid = owned.get(service)
    if uid is None:
        return f"Service {service} is not one the operator owns"
    refs = [ref for ref in meta.get("ownerReferences") or () if isinstance(ref, Mapping) and ref.get("controller")]
    if len(refs) != 1 or refs[0].get("kind") != "Service" or refs[0].get("uid") != uid:
        return f"its Service is not the operator's {service} (uid {uid})"
    return None


def _member_endpoints(slice_obj: Mapping[str, Any], statefulset: str, ignored: list[str]) -> Mapping[str, Any]:
    """Rule 3: the slice with only the endpoints whose target is a member pod of `statefulset`."""
    kept = []
    for entry in slice_obj.get("endpoints") or ():
        ref = entry.get("targetRef") or {}
        if ref.get("kind") == "Pod" and is_member_pod(str(ref.get("name") or ""), statefulset):
            kept.append(entry)
        else:
            name = (slice_obj.get("metadata") or {}).get("name")
            ignored.append(
                f"endpoint {ref.get('name') or entry.get('addresses')} of slice {name}: not a pod of {statefulset}"
            )
    return slice_obj if len(kept) == len(slice_obj.get("endpoints") or ()) else {**slice_obj, "endpoints": kept}


@dataclass(frozen=True)
class Trusted:
    """The slices (and endpoints) the router may use, and what it left out and why (for its log)."""

    slices: list[Mapping[str, Any]] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)


def trusted_slices(
    slices: Iterable[Mapping[str, Any]],
    *,
    owned: Mapping[str, str] | None,
    require_owned: bool,
    statefulset: str | None,
) -> Trusted:
    """The slices (and endpoints) of `slices` the router may use (module docstring). `require_owned`: a published
    list is configured (then `owned` None, not read yet, trusts nothing); `statefulset`: the pool's StatefulSet
    (None: any pod)."""
    if require_owned and owned is None:
        return Trusted()
    result = Trusted()
    for slice_obj in slices:
        why = why_untrusted(slice_obj, owned or {}) if require_owned else None
        if why is not None:
            result.ignored.append(f"slice {(slice_obj.get('metadata') or {}).get('name')}: {why}")
            continue
        result.slices.append(
            slice_obj if statefulset is None else _member_endpoints(slice_obj, statefulset, result.ignored)
        )
    return result
