"""The pure planner: from the rendered objects and the observed children to the writes a reconcile must make.

Algorithm:
1. `desired_objects` takes the renderer's output and adjusts the fields the operator deliberately leaves to others:
   a StatefulSet's `spec.replicas` while that pool's autoscaling is enabled. The scaler (pdserve's autoscaler in
   mode pdserve, HPA/KEDA in mode external) writes the StatefulSet's scale subresource; the operator re-applies
   the observed value, so it keeps co-owning the field (dropping it from the apply would make the API server reset
   it to 1 whenever no other manager owns it yet) without ever changing it. In mode pdserve it also keeps the value
   inside [minReplicas, maxReplicas] (the bounds hold even while the autoscaler cannot act); in mode external it
   never changes what the external scaler set. On creation the renderer's value is used.
   Such an apply carries the observed `metadata.resourceVersion` as a precondition: if a scaler wrote /scale after
   the informer cache's copy (the watch event is still on its way), the API server answers 409 Conflict instead
   of letting a stale `replicas` undo that write, and the pass is retried with the fresh object.
2. Every desired object is stamped with its applied-hash and compared with the observed object of the same kind and
   name (`drift.apply_reason`); only those with a reason are applied.
3. Every observed child that this PDService controls (controller ownerReference with its UID) but that the render
   no longer produces is pruned. Objects carrying our labels but owned by another UID (a PDService of the same name
   that was deleted and re-created, waiting for garbage collection) are left alone.
4. Never take over what another owner created (Helm's rule for a release): a desired object whose name is held by
   an object this PDService does not control (`ownership`: its controller reference, not its labels) is a
   `Conflict`, and a plan with a conflict applies and prunes nothing at all. The children name each other (the
   router Deployment mounts the router ConfigMap and runs as its ServiceAccount, the RoleBinding grants the
   Role), so applying around one refused name could run the router with another user's configuration or bind
   another user's Role. Applying over it would be worse: a forced server-side apply replaces the fields it sets
   (a Role's rules, a RoleBinding's subjects) and adds this PDService's controller reference, after which
   deleting the PDService garbage-collects the other user's object. The object is adopted only once it carries
   this PDService's controller reference (someone handed it over). A name held by a deleted predecessor of the
   same name (its controller reference names this PDService's kind and name with the old UID) is a conflict
   that resolves by itself: the garbage collector deletes it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve.api.defaults import EffectiveSpec
from pdserve_operator import drift
from pdserve_operator.kinds import MANAGED, Kind, kind_of
from pdserve_operator.names import ENGINE_ROLES, ROLE_LABEL
from pdserve_operator.observed import ObjectKey, key_of
from pdserve_operator.ownership import Holder, controlled_by, holder_of

WORKLOAD_KINDS = frozenset({"StatefulSet", "Deployment"})


@dataclass(frozen=True)
class Apply:
    """One server-side apply: the stamped object and why it is needed (for logs and events)."""

    obj: dict[str, Any]
    reason: str

    @property
    def kind(self) -> Kind:
        return kind_of(self.obj)


@dataclass(frozen=True)
class Prune:
    """One delete of a child the render no longer produces, with a UID precondition."""

    kind: Kind
    namespace: str
    name: str
    uid: str


@dataclass(frozen=True)
class Conflict:
    """A desired object whose name is held by an object this PDService does not control (module docstring, 4)."""

    kind: str
    name: str
    holder: Holder

    def describe(self) -> str:
        """`ConfigMap victim-router exists and is not controlled by any owner, written by kubectl-create`."""
        return f"{self.kind} {self.name} exists and is {self.holder.describe()}"


@dataclass
class Plan:
    applies: list[Apply] = field(default_factory=list)
    prunes: list[Prune] = field(default_factory=list)
    #: Names held by other owners; a plan with any makes no write at all.
    conflicts: list[Conflict] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.applies and not self.prunes

    def waves(self) -> list[list[Apply]]:
        """Applies grouped so each group can run concurrently: everything workloads reference (ServiceAccount,
        RBAC, ConfigMap, Services, PDBs) first, then the workloads, so pods never start before their config."""
        first = [a for a in self.applies if a.obj["kind"] not in WORKLOAD_KINDS]
        second = [a for a in self.applies if a.obj["kind"] in WORKLOAD_KINDS]
        return [wave for wave in (first, second) if wave]


def clamp_autoscaled_replicas(spec: EffectiveSpec, sts: dict[str, Any], observed: dict[str, Any] | None) -> None:
    """In place: while autoscaling is on, keep the observed replicas of an existing StatefulSet (within bounds in
    mode pdserve, as they are in mode external), under the observed resourceVersion (see the module docstring)."""
    role = sts["metadata"].get("labels", {}).get(ROLE_LABEL)
    if role not in ENGINE_ROLES or observed is None:
        return
    scaling = spec.pool(role).autoscaling
    if not scaling.enabled:
        return
    current = observed.get("spec", {}).get("replicas")
    if not isinstance(current, int):
        return
    sts["spec"]["replicas"] = current if scaling.mode == "external" else scaling.clamp(current)
    version = observed.get("metadata", {}).get("resourceVersion")
    if version:
        sts["metadata"]["resourceVersion"] = version


def desired_objects(
    spec: EffectiveSpec, rendered: Iterable[dict[str, Any]], observed: Mapping[ObjectKey, dict[str, Any]]
) -> list[dict[str, Any]]:
    """The rendered objects with the fields left to others adjusted, each stamped with its applied-hash. `spec` is
    the effective spec the objects were rendered from (the validation result's, never derived here again)."""
    result = []
    for original in rendered:
        # Hash what the spec says, *then* adopt the autoscaler's replicas: its scaling must not look like a spec
        # change (that would re-apply on every scale); out-of-bounds values still show up as drift.
        obj = drift.stamp(original)
        if obj["kind"] == "StatefulSet":
            clamp_autoscaled_replicas(spec, obj, observed.get(key_of(obj)))
        result.append(obj)
    return result


def make_plan(
    desired: Iterable[dict[str, Any]],
    observed: Mapping[ObjectKey, dict[str, Any]],
    owner_uid: str,
    foreign: Mapping[ObjectKey, dict[str, Any]] | None = None,
) -> Plan:
    """Applies for desired objects that differ from what is observed; prunes for owned leftovers; or, when an
    object of a desired name is held by another owner (in `foreign`, or in `observed` without this PDService's
    controller reference), only the conflicts (module docstring, 4)."""
    plan = Plan()
    wanted: set[ObjectKey] = set()
    held = dict(foreign or {})
    for obj in desired:
        key = key_of(obj)
        wanted.add(key)
        current = observed.get(key)
        if current is not None and not controlled_by(current, owner_uid):
            held[key] = current
        other = held.get(key)
        if other is not None:
            owner = _owner_ref(obj)
            plan.conflicts.append(Conflict(key[0], key[2], holder_of(other, owner[0], owner[1])))
            continue
        reason = drift.apply_reason(obj, current)
        if reason is not None:
            plan.applies.append(Apply(obj, reason))
    if plan.conflicts:
        plan.applies.clear()
        return plan
    managed_kinds = {kind.kind: kind for kind in MANAGED}
    for key, obj in sorted(observed.items()):
        kind = managed_kinds.get(key[0])
        if kind is None or key in wanted or not controlled_by(obj, owner_uid):
            continue
        plan.prunes.append(Prune(kind, key[1], key[2], obj["metadata"]["uid"]))
    return plan


def _owner_ref(obj: Mapping[str, Any]) -> tuple[str, str]:
    """(kind, name) of the PDService a rendered object names as its controller."""
    for ref in obj.get("metadata", {}).get("ownerReferences") or ():
        if ref.get("controller"):
            return str(ref.get("kind")), str(ref.get("name"))
    return "", ""
