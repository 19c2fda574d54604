"""Declarative topologies of simulated nodes, turned into the Node objects kwok then keeps alive.

A topology is zones -> racks -> nodes, each rack drawing its nodes from a node pool (GPU product, GPU count,
RDMA devices, CPU, memory, instance type, how many nodes share an NVLink domain). Node names and labels are
derived deterministically, so a test can name `gpu-zone-a-rack-1-0` and know what it has. A pool without GPUs
is a CPU pool (`cpu-zone-a-system-0`): untainted, no GPU labels, where pods that ask for nothing special (the
routers of a PDService) land, as on the CPU node pools of real clusters.

Labels (what real GPU clusters carry, and what pdserve's placement looks at):

- `topology.kubernetes.io/zone`, `topology.kubernetes.io/region`, `kubernetes.io/hostname`,
  `node.kubernetes.io/instance-type`: the well-known labels.
- `pdserve.io/rack`: the rack (no upstream standard exists; zone-qualified so it is unique cluster-wide).
- `nvidia.com/gpu.product`, `nvidia.com/gpu.count`, `nvidia.com/gpu.memory`: as NVIDIA's GPU feature
  discovery sets them.
- `nvidia.com/gpu.clique`: the NVLink domain, as GPU feature discovery labels multi-node NVLink (GB200 NVL)
  domains; nodes with the same value share one NVLink fabric.
- `pdserve.io/rdma`: "true" when the node has `rdma/ib` capacity.
- `type=kwok` plus the annotation `kwok.x-k8s.io/node=fake`: kwok manages exactly the annotated nodes.

The default topology has every GPU product the examples in `examples/` name: H100 racks (one without RDMA),
an H200 rack with RDMA and a GB200 rack whose four nodes form one NVLink domain, plus one CPU node per zone.

Every GPU node carries the taint `nvidia.com/gpu=present:NoSchedule` like managed GPU pools; the API server's
ExtendedResourceToleration admission plugin adds the matching toleration to pods that request GPUs.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

GPU_RESOURCE = "nvidia.com/gpu"
RDMA_RESOURCE = "rdma/ib"
RACK_LABEL = "pdserve.io/rack"
NVLINK_DOMAIN_LABEL = "nvidia.com/gpu.clique"
RDMA_LABEL = "pdserve.io/rdma"
ZONE_LABEL = "topology.kubernetes.io/zone"
REGION_LABEL = "topology.kubernetes.io/region"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
GPU_TAINT = {"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NodePool(_Model):
    """What one kind of GPU machine offers."""

    gpu_product: str = Field("NVIDIA-H100-80GB-HBM3", description="Value of nvidia.com/gpu.product.")
    gpu_memory_mib: int = Field(81559, ge=1, description="Value of nvidia.com/gpu.memory (MiB per GPU).")
    gpus: int = Field(8, ge=0, description="nvidia.com/gpu capacity per node.")
    rdma_devices: int = Field(8, ge=0, description="rdma/ib capacity per node; 0 means no RDMA fabric.")
    cpu: str = Field("192", description="CPU capacity.")
    memory: str = Field("2Ti", description="Memory capacity.")
    pods: int = Field(110, ge=1, description="Pod capacity.")
    instance_type: str = Field("p5.48xlarge", description="Value of node.kubernetes.io/instance-type.")
    nvlink_domain_nodes: int = Field(
        1, ge=1, description="Consecutive nodes of a rack that share one NVLink domain (1: the node alone)."
    )


H100 = NodePool()
H100_NO_RDMA = NodePool(rdma_devices=0, instance_type="p5e.48xlarge-nordma")
H200 = NodePool(
    gpu_product="NVIDIA-H200",
    gpu_memory_mib=143771,
    gpus=8,
    rdma_devices=8,
    cpu="192",
    memory="2Ti",
    instance_type="p5en.48xlarge",
)
CPU = NodePool(
    gpu_product="",
    gpu_memory_mib=1,
    gpus=0,
    rdma_devices=0,
    cpu="32",
    memory="128Gi",
    instance_type="m7i.8xlarge",
)
GB200 = NodePool(
    gpu_product="NVIDIA-GB200",
    gpu_memory_mib=189471,
    gpus=8,
    rdma_devices=8,
    cpu="144",
    memory="1728Gi",
    instance_type="gb200-nvl72-slice",
    nvlink_domain_nodes=4,
)


class Rack(_Model):
    """A rack: `nodes` identical machines from one pool."""

    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", description="Rack name, unique in its zone.")
    nodes: int = Field(ge=1, description="Number of nodes in the rack.")
    pool: NodePool = Field(default_factory=NodePool, description="The machines in the rack.")


class Zone(_Model):
    """An availability zone of racks."""

    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", description="topology.kubernetes.io/zone value.")
    racks: tuple[Rack, ...] = Field(min_length=1, description="Racks in the zone.")


class SimNode(_Model):
    """One simulated node, fully resolved."""

    name: str
    zone: str
    rack: str
    index: int
    pool: NodePool
    nvlink_domain: str

    @property
    def has_rdma(self) -> bool:
        return self.pool.rdma_devices > 0

    def labels(self, region: str) -> dict[str, str]:
        labels = {
            "kubernetes.io/hostname": self.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "type": "kwok",
            REGION_LABEL: region,
            ZONE_LABEL: self.zone,
            RACK_LABEL: self.rack,
            INSTANCE_TYPE_LABEL: self.pool.instance_type,
            RDMA_LABEL: "true" if self.has_rdma else "false",
        }
        if self.pool.gpus > 0:  # GPU feature discovery only labels GPU nodes
            labels |= {
                NVLINK_DOMAIN_LABEL: self.nvlink_domain,
                GPU_PRODUCT_LABEL: self.pool.gpu_product,
                "nvidia.com/gpu.count": str(self.pool.gpus),
                "nvidia.com/gpu.memory": str(self.pool.gpu_memory_mib),
            }
        return labels

    def capacity(self) -> dict[str, str]:
        resources = {
            "cpu": self.pool.cpu,
            "memory": self.pool.memory,
            "pods": str(self.pool.pods),
            "ephemeral-storage": "1Ti",
        }
        if self.pool.gpus > 0:
            resources[GPU_RESOURCE] = str(self.pool.gpus)
        if self.has_rdma:
            resources[RDMA_RESOURCE] = str(self.pool.rdma_devices)
        return resources

    def to_object(self, region: str, pod_cidr: str | None = None) -> dict[str, Any]:
        """The Node object to create. kwok's node-initialize stage fills conditions and keeps this capacity.

        `pod_cidr` becomes spec.podCIDR, from which kwok hands out this node's fake pod IPs.
        """
        capacity = self.capacity()
        spec: dict[str, Any] = {"taints": [dict(GPU_TAINT)] if self.pool.gpus > 0 else []}
        if pod_cidr is not None:
            spec["podCIDR"] = pod_cidr
            spec["podCIDRs"] = [pod_cidr]
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.name,
                "labels": self.labels(region),
                "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            },
            "spec": spec,
            "status": {"capacity": capacity, "allocatable": dict(capacity)},
        }


class Topology(_Model):
    """A named set of zones; `nodes()` expands it."""

    name: str = Field(description="Name used by `--topology`.")
    region: str = Field("local", description="topology.kubernetes.io/region of every node.")
    zones: tuple[Zone, ...] = Field(default=(), description="Zones; empty means no simulated GPU nodes.")

    def nodes(self) -> list[SimNode]:
        return list(self._iter_nodes())

    def _iter_nodes(self) -> Iterator[SimNode]:
        for zone in self.zones:
            for rack in zone.racks:
                rack_id = f"{zone.name}-{rack.name}"
                for index in range(rack.nodes):
                    # Consecutive nodes of a rack form NVLink domains of `nvlink_domain_nodes` machines.
                    domain = index // rack.pool.nvlink_domain_nodes
                    yield SimNode(
                        name=f"{'gpu' if rack.pool.gpus > 0 else 'cpu'}-{rack_id}-{index}",
                        zone=zone.name,
                        rack=rack_id,
                        index=index,
                        pool=rack.pool,
                        nvlink_domain=f"{rack_id}-nvl{domain}",
                    )

    def node_objects(self, pod_network: str | None = None) -> list[dict[str, Any]]:
        """Node objects; with `pod_network`, node i gets the i-th /24 of it as its pod CIDR."""
        nodes = self.nodes()
        if pod_network is None:
            return [node.to_object(self.region) for node in nodes]
        subnets = ipaddress.ip_network(pod_network).subnets(new_prefix=24)
        objects = []
        for node in nodes:
            subnet = next(subnets, None)
            if subnet is None:
                raise ValueError(f"{pod_network} has fewer /24 subnets than the {len(nodes)} nodes of {self.name!r}")
            objects.append(node.to_object(self.region, str(subnet)))
        return objects


def grid(
    name: str,
    zones: int,
    racks_per_zone: int,
    nodes_per_rack: int,
    *,
    pool: NodePool = H100,
    overrides: dict[tuple[int, int], NodePool] | None = None,
) -> Topology:
    """A regular topology: zones `zone-a`, `zone-b`, ... each with racks `rack-1`, `rack-2`, ...

    `overrides` maps (zone index, rack index) to a different pool, e.g. a rack without RDMA.
    """
    overrides = overrides or {}
    return Topology(
        name=name,
        zones=tuple(
            Zone(
                name=f"zone-{chr(ord('a') + z)}",
                racks=tuple(
                    Rack(name=f"rack-{r + 1}", nodes=nodes_per_rack, pool=overrides.get((z, r), pool))
                    for r in range(racks_per_zone)
                ),
            )
            for z in range(zones)
        ),
    )


def default_topology() -> Topology:
    """2 zones of 4-node GPU racks (26 nodes, 192 GPUs): in each zone two H100 racks (zone-b's rack-2 without RDMA)
    and a third rack, H200 with RDMA in zone-a and GB200 (one NVLink domain of 4 nodes) in zone-b; and one CPU
    node per zone (rack `system`)."""
    gpu_pools = {"zone-a": (H100, H100, H200), "zone-b": (H100, H100_NO_RDMA, GB200)}
    return Topology(
        name="default",
        zones=tuple(
            Zone(
                name=zone,
                racks=(
                    *(Rack(name=f"rack-{index + 1}", nodes=4, pool=pool) for index, pool in enumerate(pools)),
                    Rack(name="system", nodes=1, pool=CPU),
                ),
            )
            for zone, pools in gpu_pools.items()
        ),
    )


def minimal_topology() -> Topology:
    """Two H100 nodes in one zone, in two racks: one node with RDMA, one without."""
    return Topology(
        name="minimal",
        zones=(
            Zone(name="zone-a", racks=(Rack(name="rack-1", nodes=1), Rack(name="rack-2", nodes=1, pool=H100_NO_RDMA))),
        ),
    )


def large_topology() -> Topology:
    """4 zones x 4 racks x 8 nodes = 128 nodes for scale tests; each zone's last rack is GB200 (NVLink x4)."""
    return grid(
        "large",
        4,
        4,
        8,
        overrides={**{(z, 3): GB200 for z in range(4)}, (2, 2): H100_NO_RDMA, (3, 2): H100_NO_RDMA},
    )


def empty_topology() -> Topology:
    """No simulated nodes (e.g. only the process node)."""
    return Topology(name="none")


TOPOLOGIES = {
    "default": default_topology,
    "minimal": minimal_topology,
    "large": large_topology,
    "none": empty_topology,
}


def get_topology(name: str) -> Topology:
    """A preset by name; raise ValueError listing the known names otherwise."""
    try:
        return TOPOLOGIES[name]()
    except KeyError:
        raise ValueError(f"Unknown topology {name!r}; choose one of {', '.join(TOPOLOGIES)}") from None
