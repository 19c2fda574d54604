"""Scheduling constraints of engine pods: GPU nodes, RDMA, co-location of prefill and decode, spreading.

- GPU nodes: the GPU resource request already restricts pods to GPU nodes; `gpuNodeSelector` narrows further (GPU
  product, instance type) and the default toleration (`pdserve.api.defaults`) admits the usual `nvidia.com/gpu`
  taint of GPU pools.
- RDMA: `required` requests the RDMA extended resource (see `resources`), so only RDMA nodes fit; `preferred` adds a
  soft node affinity for nodes labelled RDMA-capable; `off` does neither (UCX then uses TCP).
- Co-location: all engine pods of one PDService share a `topologyKey` domain (rack, NVLink domain, zone), so KV
  transfers stay on the fast fabric. `required` uses a hard pod affinity to *any* engine pod of the PDService: the
  first pod matches its own term (Kubernetes' self-affinity special case) and anchors the domain; every later pod,
  prefill or decode, must join it. `preferred` is a weighted soft affinity of each pool to the other pool.
- Spreading: each pool spreads over `spreadKey` (default hostname) with ScheduleAnyway, so availability never
  blocks scheduling; co-location wins over spreading when both cannot hold.
"""

from __future__ import annotations

from typing import Any

from pdserve.api.defaults import EffectivePool, EffectiveSpec
from pdserve.api.v1alpha1 import PDService
from pdserve_operator.names import INSTANCE_LABEL, ROLE_LABEL, Role, selector_labels


def node_selector(spec: EffectiveSpec, pool: EffectivePool) -> dict[str, str]:
    return {**spec.placement.gpu_node_selector, **pool.node_selector}


def tolerations(spec: EffectiveSpec, pool: EffectivePool) -> list[dict[str, Any]]:
    both = [*spec.placement.tolerations, *pool.tolerations]
    return [t.model_dump(by_alias=True, exclude_none=True) for t in both]


def affinity(pds: PDService, spec: EffectiveSpec, role: Role) -> dict[str, Any] | None:
    placement = spec.placement
    result: dict[str, Any] = {}
    if placement.rdma == "preferred":
        result["nodeAffinity"] = {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 50,
                    "preference": {"matchExpressions": [{"key": placement.rdma_node_label, "operator": "Exists"}]},
                }
            ]
        }
    colocation = placement.colocation
    if placement.topology_key is not None and colocation != "none":
        if colocation == "required":
            engines = {
                "matchLabels": {INSTANCE_LABEL: pds.metadata.name},
                "matchExpressions": [{"key": ROLE_LABEL, "operator": "In", "values": ["prefill", "decode"]}],
            }
            result["podAffinity"] = {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {"labelSelector": engines, "topologyKey": placement.topology_key}
                ]
            }
        else:
            other: Role = "decode" if role == "prefill" else "prefill"
            result["podAffinity"] = {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 100,
                        "podAffinityTerm": {
                            "labelSelector": {"matchLabels": selector_labels(pds, other)},
                            "topologyKey": placement.topology_key,
                        },
                    }
                ]
            }
    return result or None


def topology_spread(pds: PDService, spec: EffectiveSpec, role: Role) -> list[dict[str, Any]]:
    return [
        {
            "maxSkew": spec.placement.max_skew,
            "topologyKey": spec.placement.spread_key,
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": selector_labels(pds, role)},
            # Spread each revision on its own during a rollout, not old and new pods together.
            "matchLabelKeys": ["controller-revision-hash"],
        }
    ]
