"""The kinds of child objects the operator manages, and the REST paths to reach them.

The renderer decides *what* objects exist; this table tells the IO layer *where* each kind lives in the API (group,
version, plural) so that apply, list and delete can build URLs without a discovery round trip. Every kind the
renderer can emit must be listed here: the operator prunes by walking this table, so a kind missing from it would
never be pruned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.api.v1alpha1 import GROUP, PLURAL, VERSION


@dataclass(frozen=True)
class Kind:
    """One API resource: how it is spelled in objects (apiVersion, kind) and in URLs (plural)."""

    api_version: str
    kind: str
    plural: str

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    @property
    def version(self) -> str:
        return self.api_version.rpartition("/")[2]

    def collection_path(self, namespace: str | None) -> str:
        """URL of the collection: namespaced when `namespace` is given, cluster-wide otherwise."""
        prefix = f"/apis/{self.api_version}" if self.group else f"/api/{self.version}"
        if namespace is None:
            return f"{prefix}/{self.plural}"
        return f"{prefix}/namespaces/{namespace}/{self.plural}"

    def object_path(self, namespace: str, name: str) -> str:
        return f"{self.collection_path(namespace)}/{name}"


SERVICE_ACCOUNT = Kind("v1", "ServiceAccount", "serviceaccounts")
CONFIG_MAP = Kind("v1", "ConfigMap", "configmaps")
SERVICE = Kind("v1", "Service", "services")
ROLE = Kind("rbac.authorization.k8s.io/v1", "Role", "roles")
ROLE_BINDING = Kind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings")
STATEFUL_SET = Kind("apps/v1", "StatefulSet", "statefulsets")
DEPLOYMENT = Kind("apps/v1", "Deployment", "deployments")
PDB = Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets")
# Router mode gateway only (`render.gateway`); the CRD comes with a Gateway API Inference Extension install, so the
# kind is applied and read by name when rendered, never watched or listed in every namespace (`MANAGED`).
INFERENCE_POOL = Kind("inference.networking.k8s.io/v1", "InferencePool", "inferencepools")

# Read-only kinds the operator observes to compute status; it never writes them.
POD = Kind("v1", "Pod", "pods")
ENDPOINT_SLICE = Kind("discovery.k8s.io/v1", "EndpointSlice", "endpointslices")
EVENT = Kind("v1", "Event", "events")
# Cluster-scoped, read by name only (the labels of the nodes engine pods run on: `nodes.py`).
NODE = Kind("v1", "Node", "nodes")
LEASE = Kind("coordination.k8s.io/v1", "Lease", "leases")
PDSERVICE = Kind(f"{GROUP}/{VERSION}", "PDService", PLURAL)

MANAGED: tuple[Kind, ...] = (
    SERVICE_ACCOUNT,
    ROLE,
    ROLE_BINDING,
    CONFIG_MAP,
    SERVICE,
    STATEFUL_SET,
    PDB,
    DEPLOYMENT,
)
OBSERVED: tuple[Kind, ...] = (*MANAGED, POD, ENDPOINT_SLICE)

_BY_TYPE: dict[tuple[str, str], Kind] = {
    (k.api_version, k.kind): k for k in (*OBSERVED, PDSERVICE, EVENT, LEASE, NODE, INFERENCE_POOL)
}


def kind_of(obj: dict[str, Any]) -> Kind:
    """The Kind of an object dict; KeyError for a kind this operator does not know (a renderer bug)."""
    return _BY_TYPE[(obj["apiVersion"], obj["kind"])]
