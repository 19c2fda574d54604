"""Which observed objects are a PDService's: proven by controller references and UIDs, never by labels or names.

Labels are an index (the operator watches its children by `managed-by`, files them under a PDService by
`app.kubernetes.io/instance`), not a proof: anyone who may create objects in the namespace (the built-in `edit`
role) can write any label. So every layer that acts on what it observed asks this module first:

- a child (Role, ConfigMap, Service, StatefulSet, ...) is the PDService's only when its controller
  ownerReference carries the PDService's UID. The planner never applies over any other object of a child's name
  (`plan.py`: ChildConflict), status and the autoscaler never read one;
- an engine pod is a pool's only when its controller is the pool's StatefulSet (by that StatefulSet's UID) and
  its name is one the StatefulSet gives its pods (`<statefulset>-<ordinal>`): the StatefulSet controller itself
  releases or deletes a pod claiming it under another name, and a UID cannot be guessed before it exists;
- a router pod (or a KV store pod) is the PDService's when its controller is a ReplicaSet of a Deployment the
  PDService controls, named `<deployment>-<pod-template-hash>` as the Deployment controller names them. The
  operator does not watch ReplicaSets, so the ReplicaSet's UID is not checked: a pod naming a ReplicaSet that does
  not exist is deleted by the garbage collector, and one naming the real ReplicaSet is adopted and counted by the
  ReplicaSet controller (which then deletes pods beyond its replicas);
- a router EndpointSlice is the router Service's when it was made by the EndpointSlice controller for that
  Service (its controller reference carries the owned Service's UID). The router applies the same rule to the
  pools' slices, with the Service UIDs the operator publishes for it (`render.discovery`).

Everything else that carries a PDService's labels is foreign: ignored, and reported (status or an Event).
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

__all__ = [
    "ENDPOINT_SLICE_CONTROLLER",
    "MANAGED_BY_SLICE_LABEL",
    "SERVICE_NAME_LABEL",
    "Holder",
    "PodSplit",
    "controlled_by",
    "controller_of",
    "holder_of",
    "is_replicaset_pod",
    "is_service_slice",
    "is_statefulset_pod",
    "split_pods",
]

_POD_TEMPLATE_HASH = "pod-template-hash"


def controller_of(obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The object's controller ownerReference (the API server allows at most one), or None."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or ():
        if isinstance(ref, Mapping) and ref.get("controller") is True:
            return ref
    return None


def controlled_by(obj: Mapping[str, Any], uid: str | None) -> bool:
    """True when `obj`'s controller ownerReference carries `uid` (None: nothing is controlled)."""
    ref = controller_of(obj)
    return uid is not None and ref is not None and ref.get("uid") == uid


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds an object of a child's name instead of the PDService: for the ChildConflict message."""

    #: "PDService llama (uid ...)", "Deployment x (uid ...)", or "" without a controller reference.
    controller: str
    #: Field managers that wrote the object (`metadata.managedFields`): who created and changed it.
    managers: tuple[str, ...]
    #: A PDService of the same name with another UID: the child of a deleted predecessor, which the garbage
    #: collector removes by itself (an owner reference naming an owner that does not exist by that UID is
    #: collected, so claiming this is no way to keep an object).
    predecessor: bool

    def describe(self) -> str:
        who = f"controlled by {self.controller}" if self.controller else "not controlled by any owner"
        if self.managers:
            who += f", written by {', '.join(self.managers)}"
        return who


def holder_of(obj: Mapping[str, Any], owner_kind: str, owner_name: str) -> Holder:
    """Who holds `obj` (an object the PDService `owner_name` does not control)."""
    ref = controller_of(obj)
    managers = sorted(
        {
            str(entry.get("manager"))
            for entry in (obj.get("metadata") or {}).get("managedFields") or ()
            if isinstance(entry, Mapping) and entry.get("manager")
        }
    )
    if ref is None:
        return Holder("", tuple(managers), predecessor=False)
    predecessor = ref.get("kind") == owner_kind and ref.get("name") == owner_name
    return Holder(f"{ref.get('kind')} {ref.get('name')} (uid {ref.get('uid')})", tuple(managers), predecessor)


def is_statefulset_pod(pod: Mapping[str, Any], statefulset: Mapping[str, Any]) -> bool:
    """Whether `pod` is one of `statefulset`'s: its controller is that StatefulSet (kind and UID) and its name is
    `<statefulset>-<ordinal>`."""
    ref = controller_of(pod)
    meta = statefulset.get("metadata") or {}
    uid, name = meta.get("uid"), meta.get("name")
    if ref is None or not uid or ref.get("kind") != "StatefulSet" or ref.get("uid") != uid:
        return False
    return is_member_pod(str((pod.get("metadata") or {}).get("name") or ""), str(name))


def is_replicaset_pod(pod: Mapping[str, Any], deployment_name: str) -> bool:
    """Whether `pod` belongs to a ReplicaSet of the Deployment `deployment_name` (module docstring): its controller
    is a ReplicaSet named `<deployment>-<hash>` and the pod carries that `pod-template-hash`."""
    ref = controller_of(pod)
    if ref is None or ref.get("kind") != "ReplicaSet":
        return False
    template_hash = ((pod.get("metadata") or {}).get("labels") or {}).get(_POD_TEMPLATE_HASH)
    return bool(template_hash) and ref.get("name") == f"{deployment_name}-{template_hash}"


def is_service_slice(slice_obj: Mapping[str, Any], service: Mapping[str, Any] | None) -> bool:
    """Whether an EndpointSlice was made by the EndpointSlice controller for `service` (by its UID)."""
    if service is None:
        return False
    labels = (slice_obj.get("metadata") or {}).get("labels") or {}
    meta = service.get("metadata") or {}
    return (
        labels.get(MANAGED_BY_SLICE_LABEL) == ENDPOINT_SLICE_CONTROLLER
        and labels.get(SERVICE_NAME_LABEL) == meta.get("name")
        and controlled_by(slice_obj, meta.get("uid"))
    )


@dataclass(frozen=True)
class PodSplit:
    """Pods carrying a PDService's labels: those its workloads control, and the rest."""

    owned: list[dict[str, Any]] = field(default_factory=list)
    foreign: list[dict[str, Any]] = field(default_factory=list)


def split_pods(
    pods: Iterable[dict[str, Any]],
    statefulsets: Iterable[Mapping[str, Any]],
    deployments: Iterable[str],
) -> PodSplit:
    """Split pods into the members of the (owned) `statefulsets` and of the (owned) Deployments named in
    `deployments` (the router's, the KV store's), and the foreign rest."""
    owners, deployment_names = list(statefulsets), list(deployments)
    split = PodSplit()
    for pod in pods:
        mine = any(is_statefulset_pod(pod, sts) for sts in owners) or any(
            is_replicaset_pod(pod, name) for name in deployment_names
        )
        (split.owned if mine else split.foreign).append(pod)
    return split
