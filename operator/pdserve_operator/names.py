"""Deterministic names and labels of everything rendered for a PDService: the bottom of the operator's layers.

The renderer writes these names and labels, and everything above it finds children by them (the informer cache,
status, the planner, the autoscaler's actuator, the controller's watch selector), so they live below all of them
and import nothing of the operator.

Selector labels are a strict subset of the object labels and never include anything that changes over the life of
a PDService (a StatefulSet's selector is immutable): the kv-compat hash is a pod label, never a selector label
(only the per-value Services of `render.discovery` select by it, adding it to these).
"""

from __future__ import annotations

from typing import Literal

from pdserve.api.kvcompat import KV_COMPAT_LABEL
from pdserve.api.v1alpha1 import PDService

Role = Literal["prefill", "decode", "router", "kvstore"]
EngineRole = Literal["prefill", "decode"]
ENGINE_ROLES: tuple[EngineRole, ...] = ("prefill", "decode")
ROLE_LABEL = "pdserve.io/role"
NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
COMPONENT_LABEL = "app.kubernetes.io/component"
PART_OF_LABEL = "app.kubernetes.io/part-of"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
VERSION_LABEL = "app.kubernetes.io/version"
MANAGED_BY = "pdserve-operator"
APP_NAME = "pdserve"

__all__ = [
    "COMPONENT_LABEL",
    "ENGINE_ROLES",
    "INSTANCE_LABEL",
    "KV_COMPAT_LABEL",
    "MANAGED_BY",
    "MANAGED_BY_LABEL",
    "NAME_LABEL",
    "ROLE_LABEL",
    "EngineRole",
    "Role",
    "child_name",
    "labels",
    "owner_labels",
    "router_control_name",
    "selector_labels",
]


def child_name(owner: PDService | str, role: Role) -> str:
    """`<pdservice>-<role>`: the name of every object of that role (StatefulSet, Service, PDB, ...).

    `owner` is the PDService or just its name: status and the informer cache look children up by name, also for a
    PDService whose spec does not parse, so they have no model to pass. This is the one place the rule lives."""
    name = owner if isinstance(owner, str) else owner.metadata.name
    return f"{name}-{role}"


def router_control_name(owner: PDService | str) -> str:
    """`<pdservice>-router-control`: the ConfigMap the autoscaler publishes the router's controls in (its key
    `pdserve.api.router_config.ROUTER_CONTROL_KEY`) and every router replica watches by this name."""
    return f"{owner if isinstance(owner, str) else owner.metadata.name}-router-control"


def owner_labels(pds: PDService) -> dict[str, str]:
    """Labels on every rendered object; the operator lists its children (and prunes them) by these."""
    return {
        NAME_LABEL: APP_NAME,
        INSTANCE_LABEL: pds.metadata.name,
        PART_OF_LABEL: APP_NAME,
        MANAGED_BY_LABEL: MANAGED_BY,
    }


def selector_labels(pds: PDService, role: Role) -> dict[str, str]:
    """The immutable selector of one role's pods."""
    return {NAME_LABEL: APP_NAME, INSTANCE_LABEL: pds.metadata.name, ROLE_LABEL: role}


def labels(pds: PDService, role: Role) -> dict[str, str]:
    """Object labels of one role's objects."""
    return {**owner_labels(pds), COMPONENT_LABEL: role, ROLE_LABEL: role}
