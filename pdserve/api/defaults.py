"""The one table of defaults, as the effective view of a spec: what every absent field of a PDService means.

Defaults are deliberately not in the CRD schema (the API server would write them into stored objects and freeze
them): the API server stores what the user wrote, and `effective(spec)` resolves it into a typed, frozen view in
which every absent field has its value. The renderer, validation, the kv-compat hash, the planner and status read
that view, never `x or DEFAULT`. The same lines document themselves: `crdgen` appends "Default <value>." to each
field's description in the CRD (so `kubectl explain` shows it), the CEL rules in `rules.py` interpolate the ones
they need, and `router_config.py` takes the defaults it shares with the spec from here.

Adding a field with a default is one line in its view below (plus the field in `v1alpha1.py`); a field without one
is a line with only its type. `defaulting.py` has the mechanism; derived defaults (computed from other fields) are
worked out in `effective()` at the bottom.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Literal

from pydantic import BaseModel

from pdserve.api.defaulting import default, derived, documented_defaults, fill, resolve, view
from pdserve.api.kubeformats import quantity_bytes
from pdserve.api.v1alpha1 import (
    Attention,
    AutoscalingMode,
    AutoscalingSpec,
    BlockSize,
    Colocation,
    ComputeResources,
    EngineSpec,
    EnvVar,
    FailureMode,
    GatewaySpec,
    KvBufferDevice,
    KvCacheDtype,
    KvCacheSpec,
    KvConnector,
    KvEventsSpec,
    KvEvictionPolicy,
    KvLoadFailurePolicy,
    KvOffloadSpec,
    KvStoreBackend,
    KvStoreSpec,
    ModelSpec,
    MooncakeProtocol,
    MooncakeSpec,
    PDServiceSpec,
    Percentile,
    PlacementSpec,
    PoolKvCacheSpec,
    PoolSpec,
    PullPolicy,
    RatioBounds,
    RdmaPolicy,
    RdmaSpec,
    RouterMode,
    RouterSpec,
    RoutingSpec,
    ServiceAutoscalingSpec,
    ServiceType,
    SloSpec,
    ThresholdBounds,
    Toleration,
    UcxSpec,
)

__all__ = [
    "UCX_RDMA_TRANSPORTS",
    "UCX_TCP_TRANSPORTS",
    "EffectiveAutoscaling",
    "EffectiveEngine",
    "EffectiveGateway",
    "EffectiveKvCache",
    "EffectiveKvOffload",
    "EffectiveKvStore",
    "EffectiveModel",
    "EffectiveMooncake",
    "EffectivePlacement",
    "EffectivePool",
    "EffectiveRatioBounds",
    "EffectiveRdma",
    "EffectiveResources",
    "EffectiveRouter",
    "EffectiveRouting",
    "EffectiveServiceAutoscaling",
    "EffectiveSlo",
    "EffectiveSpec",
    "EffectiveThresholdBounds",
    "EffectiveUcx",
    "default_sentences",
    "effective",
]

# UCX names its transports explicitly: a silent fallback to TCP is the most common invisible PD failure (10-40x
# TTFT), so RDMA placements ask for RDMA transports and fail loudly without them; `placement.rdma: off` asks for TCP.
UCX_RDMA_TRANSPORTS = "rc,cuda_copy,cuda_ipc"
UCX_TCP_TRANSPORTS = "tcp,cuda_copy"


def _read_only(**values: str) -> Mapping[str, str]:
    return MappingProxyType(values)


# ------------------------------------------------------------------------------------------------------- model


@view(ModelSpec)
@dataclass(frozen=True, kw_only=True)
class EffectiveModel:
    name: str
    uri: str
    revision: str | None
    hf_token_secret: str | None


# ------------------------------------------------------------------------------------------------------ engine


@view(UcxSpec)
@dataclass(frozen=True, kw_only=True)
class EffectiveUcx:
    transports: str = derived(
        f"`{UCX_RDMA_TRANSPORTS}` when placement.rdma is required or preferred, `{UCX_TCP_TRANSPORTS}` when off"
    )
    net_devices: str | None = default(None, doc="all devices (UCX chooses)")


@view(KvEventsSpec)
@dataclass(frozen=True, kw_only=True)
class EffectiveKvEvents:
    enabled: bool = default(True)
    port: int = default(5557)
    replay_port: int = default(5657)


# One Mooncake master per PDService (pdserve's or the user's): these are its ports, the engines' client config and the
# deployed Service agree on them.
MOONCAKE_RPC_PORT = 50051
MOONCAKE_METADATA_PORT = 8080
MOONCAKE_METRICS_PORT = 9003
MOONCAKE_STORE_PORT = 50052


@view(KvOffloadSpec)
@dataclass(frozen=True, kw_only=True)
class EffectiveKvOffload:
    cpu_bytes: str | None = default(None, doc="no CPU tier")
    eviction_policy: KvEvictionPolicy = default("lru")

    @property
    def enabled(self) -> bool:
        """A CPU tier exists: cpuBytes is set and not zero."""
        return self.cpu_bytes is not None and quantity_bytes(self.cpu_bytes) > 0


@view(PoolKvCacheSpec)
@dataclass(frozen=True, kw_only=True)
class EffectivePoolKvCache:
    offload: EffectiveKvOffload = derived("spec.engine.kvCache.offload, each field the pool leaves out from there")


@view(MooncakeSpec)
@dataclass(frozen=True, kw_only=True)
class EffectiveMooncake:
    master_address: str | None = default(
        None,
        doc="pdserve deploys a master and a store server, reached at "
        f"<name>-kvstore.<namespace>.svc:{MOONCAKE_RPC_PORT}",
    )
    metadata_server: str | None = default(
        None,
        doc=f"the master's own HTTP metadata server: port {MOONCAKE_METADATA_PORT} of the deployed master's Service, "
        "or of masterAddress's host",
    )
    image: str = derived("spec.engine.image (vLLM's image ships Mooncake's mooncake_master and mooncake_client)")
    capacity_bytes: str = default("16Gi")
    local_buffer_bytes: str = default("1Gi")
    protocol: MooncakeProtocol = derived("rdma unless placement.rdma is off, then tcp")
    device_names: str = default("", doc="empty (Mooncake picks the devices)")

    @property
    def managed(self) -> bool:
        """pdserve deploys the master and its store server (no masterAddress was given)."""
        return self.master_address is None


@view(KvStoreSpec)
@dataclass(frozen=True, kw_only=True)
class EffectiveKvStore:
    backend: KvStoreBackend | None = default(None, doc="no store")
    mooncake: EffectiveMooncake

    @property
    def enabled(self) -> bool:
        return self.backend is not None


@view(KvCacheSpec)
@dataclass(frozen=True, kw_only=True)
class EffectiveKvCache:
    offload: EffectiveKvOffload
    store: EffectiveKvStore


@view(EngineSpec)
@dataclass(frozen=True, kw_only=True)
class EffectiveEngine:
    image: str
    image_pull_policy: PullPolicy | None = default(
        None, doc="unset: Kubernetes decides (IfNotPresent; Always for :latest)"
    )
    kv_connector: KvConnector = default("nixl")
    kv_buffer_device: KvBufferDevice = default("cuda")
    kv_cache_dtype: KvCacheDtype = default("auto")
    block_size: BlockSize = default(16)
    max_model_len: int | None
    attention: Attention = default("standard")
    port: int = default(8000)
    side_channel_port: int = default(5600)
    kv_lease_seconds: int = default(30)
    kv_load_failure_policy: KvLoadFailurePolicy = default("fail")
    drain_seconds: int = default(120)
    ucx: EffectiveUcx
    kv_events: EffectiveKvEvents
    kv_cache: EffectiveKvCache
    args: tuple[str, ...]
    env: tuple[EnvVar, ...]
    shm_size: str = default("16Gi")
    run_as_user: int | None = default(None, doc="unset: the image's user (root in vLLM's official image)")


# ------------------------------------------------------------------------------------------------------- pools


@view(RdmaSpec)
@dataclass(frozen=True, kw_only=True)
class EffectiveRdma:
    resource_name: str = default("rdma/ib")
    count: int = default(1)


@view(AutoscalingSpec)
@dataclass(frozen=True, kw_only=True)
class EffectiveAutoscaling:
    enabled: bool = default(False)
    min_replicas: int = default(1)
    max_replicas: int = default(8)
    target_milliseconds: float | None = derived(
        "spec.slo.ttftMilliseconds for prefill, spec.slo.itlMilliseconds for decode"
    )
    mode: AutoscalingMode = default("pdserve")

    def clamp(self, replicas: int) -> int:
        """`replicas` kept inside [minReplicas, maxReplicas]: the one place the autoscaling bounds are applied
        (the renderer's starting size, the planner's re-apply of the autoscaler's value, status)."""
        return max(self.min_replicas, min(self.max_replicas, replicas))


@view(ComputeResources)
@dataclass(frozen=True, kw_only=True)
class EffectiveResources:
    requests: Mapping[str, str]
    limits: Mapping[str, str]

    def as_dict(self) -> dict[str, Any]:
        """The container `resources` block (empty maps left out, as Kubernetes would drop them)."""
        return {key: dict(value) for key, value in (("requests", self.requests), ("limits", self.limits)) if value}


@view(PoolSpec)
@dataclass(frozen=True, kw_only=True)
class EffectivePool:
    replicas: int = derived("1, or autoscaling.minReplicas when autoscaling is enabled")
    tensor_parallel_size: int = default(1)
    data_parallel_size: int = default(1)
    gpus_per_pod: int = derived("tensorParallelSize x dataParallelSize")
    rdma: EffectiveRdma
    resources: EffectiveResources
    node_selector: Mapping[str, str]
    tolerations: tuple[Toleration, ...]
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    args: tuple[str, ...]
    env: tuple[EnvVar, ...]
    autoscaling: EffectiveAutoscaling
    kv_cache: EffectivePoolKvCache
    max_unavailable: int = default(1)

    @property
    def desired_replicas(self) -> int:
        """Replicas the StatefulSet starts with: the spec's, clamped into the bounds while autoscaling is on."""
        return self.autoscaling.clamp(self.replicas) if self.autoscaling.enabled else self.replicas


# --------------------------------------------------------------------------------------------------- placement

# The usual taint of GPU node pools (GKE, AKS and the GPU operator's examples all use it).
_GPU_TOLERATION = Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")


@view(PlacementSpec)
@dataclass(frozen=True, kw_only=True)
class EffectivePlacement:
    gpu_resource_name: str = default("nvidia.com/gpu")
    gpu_node_selector: Mapping[str, str]
    tolerations: tuple[Toleration, ...] = default(
        (_GPU_TOLERATION,), doc="one toleration of the nvidia.com/gpu taint (operator Exists, effect NoSchedule)"
    )
    rdma: RdmaPolicy = default("required")
    rdma_node_label: str = default("pdserve.io/rdma")
    topology_key: str | None
    colocation: Colocation = default("preferred", doc="preferred (it takes effect only with a topologyKey)")
    spread_key: str = default("kubernetes.io/hostname")
    max_skew: int = default(1)


# ------------------------------------------------------------------------------------------------------ router


@view(RoutingSpec)
@dataclass(frozen=True, kw_only=True)
class EffectiveRouting:
    disaggregation_threshold: int = default(256)
    prefix_aware: bool = default(True)
    fallback_to_decode: bool = default(True)
    # Off until issue 19's benchmark shows late binding beating engine queues at the code trace: on, a request the
    # engines would still serve late is shed with 503 after the router's queue deadline.
    late_binding: bool = default(False)


@view(GatewaySpec)
@dataclass(frozen=True, kw_only=True)
class EffectiveGateway:
    # FailClose: a gateway that cannot ask the picker must not send long prompts to decode engines unplanned.
    failure_mode: FailureMode = default("FailClose")
    sidecar_port: int = default(8100)
    # The port GIE's reference picker and its gateway examples use for ext_proc.
    picker_port: int = default(9002)


@view(RouterSpec)
@dataclass(frozen=True, kw_only=True)
class EffectiveRouter:
    mode: RouterMode = default("router")
    gateway: EffectiveGateway
    replicas: int = default(2)
    image: str = default("ghcr.io/pdserve/pdserve:0.1.0")
    port: int = default(8080)
    service_type: ServiceType = default("ClusterIP")
    routing: EffectiveRouting
    resources: EffectiveResources = default(
        EffectiveResources(requests=_read_only(cpu="1", memory="512Mi"), limits=_read_only(memory="2Gi")),
        doc="requests cpu 1 and memory 512Mi, limits memory 2Gi",
    )
    node_selector: Mapping[str, str]
    tolerations: tuple[Toleration, ...]


# --------------------------------------------------------------------------------------------------------- slo


@view(SloSpec)
@dataclass(frozen=True, kw_only=True)
class EffectiveSlo:
    ttft_milliseconds: float | None
    itl_milliseconds: float | None
    percentile: Percentile = default(90)


@view(RatioBounds)
@dataclass(frozen=True, kw_only=True)
class EffectiveRatioBounds:
    min: float | None = default(None, doc="unbounded")
    max: float | None = default(None, doc="unbounded")


@view(ThresholdBounds)
@dataclass(frozen=True, kw_only=True)
class EffectiveThresholdBounds:
    min_tokens: int | None = default(None, doc="spec.router.routing.disaggregationThreshold")
    max_tokens: int | None = default(None, doc="spec.router.routing.disaggregationThreshold")


@view(ServiceAutoscalingSpec)
@dataclass(frozen=True, kw_only=True)
class EffectiveServiceAutoscaling:
    max_gpus: int | None = default(None, doc="unlimited")
    prefill_to_decode_ratio: EffectiveRatioBounds
    warmup_seconds: int = default(60)
    scale_down_stabilization_seconds: int = default(180)
    burst_memory_seconds: int = default(300)
    disaggregation_threshold: EffectiveThresholdBounds


# -------------------------------------------------------------------------------------------------------- spec


@view(PDServiceSpec)
@dataclass(frozen=True, kw_only=True)
class EffectiveSpec:
    model: EffectiveModel
    engine: EffectiveEngine
    prefill: EffectivePool
    decode: EffectivePool
    placement: EffectivePlacement
    router: EffectiveRouter
    slo: EffectiveSlo
    autoscaling: EffectiveServiceAutoscaling

    def pool(self, role: Literal["prefill", "decode"]) -> EffectivePool:
        return self.prefill if role == "prefill" else self.decode

    def disaggregation_threshold_bounds(self) -> tuple[int, int, int]:
        """(configured, lowest, highest) disaggregation threshold: the router's configured value and the bounds the
        autoscaler moves it within (each defaults to the configured value; the autoscaler chooses only when the
        lowest is below the highest)."""
        configured = self.router.routing.disaggregation_threshold
        bounds = self.autoscaling.disaggregation_threshold
        low = configured if bounds.min_tokens is None else bounds.min_tokens
        high = configured if bounds.max_tokens is None else bounds.max_tokens
        return configured, low, high


def default_sentences(model: type[BaseModel]) -> dict[str, str]:
    """Field name -> "Default <value>." for each field of `model` the table gives a default (crdgen appends it to
    the field's description; importing it from here guarantees the table is loaded)."""
    return {name: f"Default {text}." for name, text in documented_defaults(model).items()}


def effective(spec: PDServiceSpec) -> EffectiveSpec:
    """The effective view of `spec`: constants from the table, then the derived defaults, which need other fields."""
    view_ = resolve(EffectiveSpec, spec)
    transports = UCX_RDMA_TRANSPORTS if view_.placement.rdma != "off" else UCX_TCP_TRANSPORTS
    store = view_.engine.kv_cache.store
    mooncake = fill(
        store.mooncake, image=view_.engine.image, protocol="rdma" if view_.placement.rdma != "off" else "tcp"
    )
    kv_cache = replace(view_.engine.kv_cache, store=replace(store, mooncake=mooncake))
    engine = replace(view_.engine, ucx=fill(view_.engine.ucx, transports=transports), kv_cache=kv_cache)
    offload = kv_cache.offload
    return replace(
        view_,
        engine=engine,
        prefill=_pool(view_.prefill, view_.slo.ttft_milliseconds, spec.prefill, offload),
        decode=_pool(view_.decode, view_.slo.itl_milliseconds, spec.decode, offload),
    )


def _pool(
    pool: EffectivePool, slo_target: float | None, written: PoolSpec, engine_offload: EffectiveKvOffload
) -> EffectivePool:
    scaling = fill(pool.autoscaling, target_milliseconds=slo_target)
    # A pool's offload replaces the engine's field by field: only the fields the pool itself wrote.
    mine = written.kv_cache.offload if written.kv_cache is not None else None
    overrides = mine.model_dump(exclude_none=True) if mine is not None else {}
    kv_cache = EffectivePoolKvCache(offload=replace(engine_offload, **overrides))
    return fill(
        replace(pool, autoscaling=scaling, kv_cache=kv_cache),
        replicas=scaling.min_replicas if scaling.enabled else 1,
        gpus_per_pod=pool.tensor_parallel_size * pool.data_parallel_size,
    )
