"""Scheduling constraints of engine pods: GPU nodes, RDMA, co-location of prefill and decode, spreading.

- GPU nodes: the GPU resource request already restricts pods to GPU nodes; `gpuNodeSelector` narrows further (GPU
  product, instance type) and the default toleration admits the usual `nvidia.com/gpu` taint of GPU pools.
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

from pdserve.api import defaults
from pdserve.api.v1alpha1 import PDService, PlacementSpec, PoolSpec
from pdserve_operator.render.names import INSTANCE_LABEL, ROLE_LABEL, Role, selector_labels

_DEFAULT_GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def rdma_policy(pds: PDService) -> str:
    placement = pds.spec.placement
    return (placement.rdma if placement else None) or defaults.RDMA_POLICY


def node_selector(pds: PDService, pool: PoolSpec) -> dict[str, str]:
    placement = pds.spec.placement or PlacementSpec()
    return {**placement.gpu_node_selector, **pool.node_selector}


def tolerations(pds: PDService, pool: PoolSpec) -> list[dict[str, Any]]:
    placement = pds.spec.placement or PlacementSpec()
    base: list[dict[str, Any]]
    if placement.tolerations is None:
        base = [dict(_DEFAULT_GPU_TOLERATION)]
    else:
        base = [t.model_dump(by_alias=True, exclude_none=True) for t in placement.tolerations]
    return base + [t.model_dump(by_alias=True, exclude_none=True) for t in pool.tolerations]


def affinity(pds: PDService, role: Role) -> dict[str, Any] | None:
    placement = pds.spec.placement or PlacementSpec()
    result: dict[str, Any] = {}
    if rdma_policy(pds) == "preferred":
        label = placement.rdma_node_label or defaults.RDMA_NODE_LABEL
        result["nodeAffinity"] = {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 50,
                    "preference": {"matchExpressions": [{"key": label, "operator": "Exists"}]},
                }
            ]
        }
    colocation = placement.colocation or defaults.COLOCATION
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


def topology_spread(pds: PDService, role: Role) -> list[dict[str, Any]]:
    placement = pds.spec.placement or PlacementSpec()
    return [
        {
            "maxSkew": placement.max_skew or defaults.MAX_SKEW,
            "topologyKey": placement.spread_key or defaults.SPREAD_KEY,
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": selector_labels(pds, role)},
            # Spread each revision on its own during a rollout, not old and new pods together.
            "matchLabelKeys": ["controller-revision-hash"],
        }
    ]
