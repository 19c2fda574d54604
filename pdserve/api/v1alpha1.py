"""PDService v1alpha1: the pydantic models that are the single source of truth for the API.

The CRD in `crds/pdservice.yaml` is generated from these models (`pdserve crd`), never edited by hand. Conventions:
camelCase aliases, `extra="forbid"`, a description on every field, constraints (`ge`, `pattern`, `Literal`) in
the schema, and no defaults in the generated schema, so the API server stores what the user wrote and the operator
decides what an absent field means (a later pdserve version can change a default without rewriting stored objects).

Two things these models deliberately do not say, because each has its own single table that `crdgen.py` joins
into the CRD: what an absent field means (`defaults.py`, which also appends the "Default ..." sentence to the
field's description) and the cross-field rules (`rules.py`, which become CEL `x-kubernetes-validations` and the
matching Python checks). A description here states what a field is, never its default.

Field design follows the anchors of the field: llm-d's modelservice values (model URI schemes, per-role pools),
Dynamo's DynamoGraphDeployment (per-component replicas/resources), KServe's LLMInferenceService (prefill/decode
split with a router), LeaderWorkerSet (topology placement).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints
from pydantic.alias_generators import to_camel

from pdserve.api.kubeformats import (
    EnvVarName,
    ExtendedResourceName,
    LabelKey,
    LabelSelectorMap,
    LabelValue,
    Namespace,
    Quantity,
    ResourceMap,
    SecretName,
    TolerationKey,
)

GROUP = "pdserve.io"
VERSION = "v1alpha1"
KIND = "PDService"
PLURAL = "pdservices"
SINGULAR = "pdservice"
SHORT_NAMES = ["pds"]
API_VERSION = f"{GROUP}/{VERSION}"

# Child names are "<name>-prefill-<ordinal>" and StatefulSet pods get a controller-revision-hash label of
# "<sts name>-<10 chars>", which must fit in 63 characters; Services need DNS-1035 names (leading letter).
MAX_NAME_LENGTH = 40
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"

# Kubernetes' own string formats (label keys and values, resource names, quantities, env var names, namespaces) come
# from kubeformats, which checks them in Python and states them in the CRD alike: a value the CRD admits must never
# be refused later by the API server in a rendered StatefulSet or Deployment.
# Tolerations per list: far more than any node pool needs, and a bound the API server's CEL cost estimate needs (each
# toleration key carries a CEL check; an unbounded list makes its estimated cost unbounded).
MAX_TOLERATIONS = 64
ImageRef = Annotated[str, StringConstraints(min_length=1, max_length=512, pattern=r"^\S+$")]

# Enumerations, named because the effective view (`defaults.py`) types its fields with them too.
PullPolicy = Literal["Always", "IfNotPresent", "Never"]
KvConnector = Literal["nixl"]
KvBufferDevice = Literal["cuda", "cpu"]
KvCacheDtype = Literal["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"]
BlockSize = Literal[1, 8, 16, 32, 64, 128]
Attention = Literal["standard", "mla"]
KvLoadFailurePolicy = Literal["fail", "recompute"]
RdmaPolicy = Literal["required", "preferred", "off"]
Colocation = Literal["required", "preferred", "none"]
ServiceType = Literal["ClusterIP", "NodePort", "LoadBalancer"]
Percentile = Literal[50, 90, 95, 99]
AutoscalingMode = Literal["pdserve", "external"]
KvEvictionPolicy = Literal["lru", "arc"]
KvStoreBackend = Literal["mooncake"]
MooncakeProtocol = Literal["tcp", "rdma"]
RouterMode = Literal["router", "gateway"]
FailureMode = Literal["FailOpen", "FailClose"]


class ApiModel(BaseModel):
    """Base for every API model: camelCase on the wire, unknown fields rejected."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=True,
        # Keep the user's field order when dumping; makes `pdserve render` diffs readable.
        protected_namespaces=(),
    )


# --------------------------------------------------------------------------------------------------- Kubernetes bits


class EnvVar(ApiModel):
    """An environment variable, shaped like core/v1 EnvVar (valueFrom is passed through unchanged)."""

    name: EnvVarName = Field(description="Variable name.")
    value: str | None = Field(default=None, description="Literal value.")
    value_from: dict[str, Any] | None = Field(
        default=None,
        description="A core/v1 EnvVarSource (fieldRef, secretKeyRef, configMapKeyRef, resourceFieldRef).",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )


class Toleration(ApiModel):
    """A pod toleration, shaped like core/v1 Toleration."""

    key: TolerationKey | None = Field(
        default=None, description="Taint key the toleration applies to; empty matches all."
    )
    operator: Literal["Exists", "Equal"] | None = Field(default=None, description="Exists or Equal.")
    value: LabelValue | None = Field(default=None, description="Taint value to match when operator is Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to match; empty matches all effects."
    )
    toleration_seconds: int | None = Field(
        default=None, description="How long a NoExecute taint is tolerated before eviction."
    )


class ComputeResources(ApiModel):
    """CPU and memory (and any extra resources) of a container, as Kubernetes quantities."""

    requests: ResourceMap = Field(default_factory=dict, description="Resource requests, e.g. cpu: '8'.")
    limits: ResourceMap = Field(default_factory=dict, description="Resource limits, e.g. memory: 64Gi.")


# ----------------------------------------------------------------------------------------------------------- model


class ModelSpec(ApiModel):
    """The model being served and where its weights come from."""

    name: str = Field(
        min_length=1,
        max_length=253,
        description="Served model name: what clients send as `model` and what /v1/models lists.",
    )
    uri: str = Field(
        pattern=r"^(hf://[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9._-]+)?|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/.*)?|/.*)$",
        max_length=1024,
        description=(
            "Where the weights come from: `hf://org/name` (downloaded by the engine from the Hugging Face hub), "
            "`pvc://claim/path` (a PersistentVolumeClaim mounted read-only), or an absolute path already on the node."
        ),
    )
    revision: str | None = Field(
        default=None,
        max_length=128,
        description="Model revision (hf:// only): a branch, tag or commit. Pin a commit for reproducible KV compat.",
    )
    hf_token_secret: SecretName | None = Field(
        default=None,
        description="Name of a Secret with key HF_TOKEN, for gated hf:// models.",
    )


# ---------------------------------------------------------------------------------------------------------- engine


class UcxSpec(ApiModel):
    """UCX transport settings for NIXL; the defaults prefer RDMA and fail loudly rather than silently use TCP."""

    transports: str | None = Field(
        default=None,
        description="UCX_TLS value.",
    )
    net_devices: str | None = Field(default=None, description="UCX_NET_DEVICES value, e.g. mlx5_0:1.")


class KvEventsSpec(ApiModel):
    """vLLM's KV cache events (`--kv-events-config`): each engine publishes what its prefix cache holds, so every
    router replica routes on the same, exact picture."""

    enabled: bool | None = Field(default=None, description="Publish KV cache events for the router's prefix index.")
    port: int | None = Field(
        default=None, ge=1, le=65535, description="ZMQ publisher port (a data-parallel rank r publishes on port + r)."
    )
    replay_port: int | None = Field(
        default=None, ge=1, le=65535, description="ZMQ replay port (a data-parallel rank r answers on replayPort + r)."
    )


class KvOffloadSpec(ApiModel):
    """A CPU tier behind each engine's GPU KV cache: vLLM's OffloadingConnector (composed with NIXL by MultiConnector).

    Blocks evicted from GPU memory are kept in host memory and loaded back on a prefix hit, so a conversation whose
    turns arrive minutes apart still finds its prefix. Needs GPU engines (vLLM 0.32's offloading calls CUDA)."""

    cpu_bytes: Quantity | None = Field(
        default=None,
        description=(
            "Host memory per engine for offloaded KV blocks (vLLM's cpu_bytes_to_use), e.g. 64Gi; absent or 0: no "
            "CPU tier. It comes on top of the pod's memory request: size resources.limits.memory for it."
        ),
    )
    eviction_policy: KvEvictionPolicy | None = Field(
        default=None, description="Which offloaded blocks make room first (vLLM's eviction_policy): lru or arc."
    )


class PoolKvCacheSpec(ApiModel):
    """One pool's KV tiers, replacing spec.engine.kvCache's for that pool field by field."""

    offload: KvOffloadSpec | None = Field(default=None, description="This pool's CPU tier (cpuBytes 0 turns it off).")


class MooncakeSpec(ApiModel):
    """The Mooncake store: a master (metadata and allocation) and the memory that holds the KV blocks."""

    master_address: str | None = Field(
        default=None,
        max_length=253,
        pattern=r"^[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?:[0-9]{1,5}$",
        description=(
            "host:port of an existing Mooncake master's RPC service; its store servers hold the memory. Absent: "
            "pdserve deploys a master with a store server of capacityBytes beside it, and health-checks them."
        ),
    )
    metadata_server: str | None = Field(
        default=None,
        max_length=1024,
        pattern=r"^(https?://\S+|P2PHANDSHAKE)$",
        description=(
            "The transfer engines' metadata server (Mooncake's metadata_server), e.g. http://host:8080/metadata. "
            "Only with masterAddress: a deployed master serves its own."
        ),
    )
    image: ImageRef | None = Field(
        default=None, description="Image of the deployed master and store server (mooncake_master, mooncake_client)."
    )
    capacity_bytes: Quantity | None = Field(
        default=None,
        description="Memory of the deployed store server: how much KV the store holds before it evicts.",
    )
    local_buffer_bytes: Quantity | None = Field(
        default=None, description="Each engine's staging buffer for puts and gets (Mooncake's local_buffer_size)."
    )
    protocol: MooncakeProtocol | None = Field(default=None, description="Transfer engine protocol: tcp or rdma.")
    device_names: str | None = Field(
        default=None, max_length=1024, description="RDMA devices of the transfer engine, e.g. mlx5_0,mlx5_1."
    )


class KvStoreSpec(ApiModel):
    """A KV store prefill writes every computed prompt into and any engine reads back: vLLM's MooncakeStoreConnector
    (composed with NIXL by MultiConnector). Decode still pulls over NIXL first; the store is what survives a prefill
    engine, and what a second decode engine (or a later turn on another engine) loads instead of a new prefill."""

    backend: KvStoreBackend | None = Field(default=None, description="Store backend: mooncake; absent: no store.")
    mooncake: MooncakeSpec | None = Field(default=None, description="Mooncake settings (backend mooncake).")


class KvCacheSpec(ApiModel):
    """Where KV lives besides each engine's GPU memory: a CPU tier per engine and a store shared by all engines."""

    offload: KvOffloadSpec | None = Field(default=None, description="A CPU tier in every engine of both pools.")
    store: KvStoreSpec | None = Field(default=None, description="A KV store shared by both pools.")


class EngineSpec(ApiModel):
    """The inference engine, shared by both pools because P and D must agree on it to exchange KV cache."""

    image: ImageRef = Field(description="vLLM image, e.g. vllm/vllm-openai:v0.32.0.")
    image_pull_policy: PullPolicy | None = Field(
        default=None, description="Image pull policy of the engine containers."
    )
    kv_connector: KvConnector | None = Field(
        default=None,
        description="KV transfer connector between prefill and decode. Only `nixl` (vLLM NixlConnector) today.",
    )
    kv_buffer_device: KvBufferDevice | None = Field(default=None, description="Where NIXL registers KV buffers.")
    kv_cache_dtype: KvCacheDtype | None = Field(default=None, description="KV cache dtype (vLLM --kv-cache-dtype).")
    block_size: BlockSize | None = Field(default=None, description="KV cache block size in tokens (vLLM --block-size).")
    max_model_len: int | None = Field(
        default=None, ge=16, le=10_485_760, description="Maximum context length (vLLM --max-model-len)."
    )
    attention: Attention | None = Field(
        default=None,
        description=(
            "Attention family. `standard` cannot pair a prefill TP larger than the decode TP; "
            "`mla` (DeepSeek-style latent attention) replicates KV and allows it."
        ),
    )
    port: int | None = Field(default=None, ge=1, le=65535, description="Engine HTTP port.")
    side_channel_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="NIXL side-channel port (VLLM_NIXL_SIDE_CHANNEL_PORT).",
    )
    kv_lease_seconds: int | None = Field(
        default=None, ge=1, le=3600, description="How long prefill holds un-pulled KV blocks, in seconds."
    )
    kv_load_failure_policy: KvLoadFailurePolicy | None = Field(
        default=None,
        description="What decode does when a KV pull fails: fail (HTTP 500) or recompute.",
    )
    drain_seconds: int | None = Field(
        default=None,
        ge=0,
        le=3600,
        description=(
            "How long a terminating engine (scale-down, rollout, eviction) keeps finishing the requests it accepted "
            "while refusing new ones (vLLM --shutdown-timeout); a prefill engine also keeps serving KV pulls of "
            "blocks it handed out, for at least kvLeaseSeconds. 0 aborts in-flight requests at termination."
        ),
    )
    ucx: UcxSpec | None = Field(default=None, description="UCX transport overrides.")
    kv_events: KvEventsSpec | None = Field(default=None, description="KV cache events for the router.")
    kv_cache: KvCacheSpec | None = Field(
        default=None,
        description=(
            "KV tiers beyond direct prefill -> decode transfer: a CPU offload tier and a shared KV store "
            "(rendered as vLLM's MultiConnector around NixlConnector; docs/kv-cache.md says when to choose which)."
        ),
    )
    args: list[str] = Field(default_factory=list, description="Extra engine arguments for both pools.")
    env: list[EnvVar] = Field(default_factory=list, description="Extra environment for both pools.")
    shm_size: Quantity | None = Field(default=None, description="Size of the /dev/shm emptyDir.")
    run_as_user: int | None = Field(
        default=None,
        ge=1,
        le=2_147_483_647,
        description=(
            "Run the engine containers as this non-root user ID (with runAsNonRoot), which Pod Security "
            "`restricted` requires. Only for images built for it: vLLM's official image runs as root and keeps "
            "its caches under /root."
        ),
    )


# ------------------------------------------------------------------------------------------------------------ pools


class RdmaSpec(ApiModel):
    """The RDMA device resource a pod requests (e.g. from the RDMA shared device plugin)."""

    resource_name: ExtendedResourceName | None = Field(default=None, description="Extended resource name.")
    count: int | None = Field(default=None, ge=1, le=64, description="Devices per pod.")


class AutoscalingSpec(ApiModel):
    """SLO-driven autoscaling of one pool (prefill scales on TTFT, decode on inter-token latency)."""

    enabled: bool | None = Field(default=None, description="Turn autoscaling on.")
    min_replicas: int | None = Field(default=None, ge=0, description="Lower bound.")
    max_replicas: int | None = Field(default=None, ge=1, description="Upper bound.")
    target_milliseconds: float | None = Field(
        default=None,
        gt=0,
        description="SLO target for this pool (TTFT for prefill, ITL for decode).",
    )
    mode: AutoscalingMode | None = Field(
        default=None,
        description=(
            "Who scales this pool when autoscaling is enabled. pdserve: the operator's SLO autoscaler. external: "
            "another autoscaler (HPA, KEDA) owns the pool's /scale; pdserve neither scales it nor overwrites the "
            "replicas that autoscaler set."
        ),
    )


class PoolSpec(ApiModel):
    """One engine pool (prefill or decode): its size, parallelism, hardware and extra settings."""

    replicas: int | None = Field(
        default=None,
        ge=0,
        le=1024,
        description="Engine pods. With autoscaling enabled: the starting size, clamped into its bounds.",
    )
    tensor_parallel_size: int | None = Field(default=None, ge=1, le=64, description="vLLM --tensor-parallel-size.")
    data_parallel_size: int | None = Field(
        default=None, ge=1, le=64, description="vLLM --data-parallel-size inside one pod."
    )
    gpus_per_pod: int | None = Field(default=None, ge=0, le=64, description="GPUs per pod.")
    rdma: RdmaSpec | None = Field(default=None, description="RDMA device request; used unless placement.rdma=off.")
    resources: ComputeResources | None = Field(default=None, description="CPU and memory of the engine container.")
    node_selector: LabelSelectorMap = Field(default_factory=dict, description="Extra node selector for this pool.")
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=MAX_TOLERATIONS, description="Extra tolerations for this pool."
    )
    max_num_seqs: int | None = Field(default=None, ge=1, description="vLLM --max-num-seqs for this pool.")
    max_num_batched_tokens: int | None = Field(
        default=None, ge=1, description="vLLM --max-num-batched-tokens for this pool."
    )
    args: list[str] = Field(default_factory=list, description="Extra engine arguments for this pool.")
    env: list[EnvVar] = Field(default_factory=list, description="Extra environment for this pool.")
    autoscaling: AutoscalingSpec | None = Field(default=None, description="SLO-driven autoscaling.")
    kv_cache: PoolKvCacheSpec | None = Field(
        default=None, description="This pool's KV tiers, overriding spec.engine.kvCache field by field."
    )
    max_unavailable: int | None = Field(
        default=None, ge=0, description="PodDisruptionBudget maxUnavailable for the pool."
    )


# ------------------------------------------------------------------------------------------------------- placement


class PlacementSpec(ApiModel):
    """Where engine pods go: GPU nodes, RDMA, co-location of prefill and decode, and spreading."""

    gpu_resource_name: ExtendedResourceName | None = Field(default=None, description="GPU resource.")
    gpu_node_selector: LabelSelectorMap = Field(
        default_factory=dict,
        description="Node selector for GPU nodes of both pools, e.g. the GPU product label.",
    )
    tolerations: list[Toleration] | None = Field(
        max_length=MAX_TOLERATIONS,
        default=None,
        description="Tolerations for both pools.",
    )
    rdma: RdmaPolicy | None = Field(
        default=None,
        description=(
            "RDMA policy. required: request the RDMA resource (pods only fit RDMA nodes). preferred: no request, "
            "prefer nodes labelled with rdmaNodeLabel. off: TCP only (expect 10-40x worse TTFT)."
        ),
    )
    rdma_node_label: LabelKey | None = Field(
        default=None,
        description="Node label marking RDMA-capable nodes, for rdma=preferred.",
    )
    topology_key: LabelKey | None = Field(
        default=None,
        description=(
            "Node label of the domain prefill and decode should share: a rack, NVLink domain or zone, e.g. "
            "topology.kubernetes.io/zone."
        ),
    )
    colocation: Colocation | None = Field(
        default=None,
        description="Whether prefill and decode must/should share a topologyKey domain.",
    )
    spread_key: LabelKey | None = Field(
        default=None,
        description="Node label to spread each pool's pods over for availability.",
    )
    max_skew: int | None = Field(default=None, ge=1, description="Spread max skew.")


# --------------------------------------------------------------------------------------------------------- router


class RoutingSpec(ApiModel):
    """How the router sends each request."""

    disaggregation_threshold: int | None = Field(
        default=None,
        ge=0,
        description=(
            "Prompts with at least this many uncached prompt tokens go through prefill then decode; shorter or "
            "cached ones go straight to decode. 0 disaggregates everything."
        ),
    )
    prefix_aware: bool | None = Field(
        default=None, description="Prefer engines likely to hold the prompt's prefix in cache."
    )
    fallback_to_decode: bool | None = Field(
        default=None,
        description="When no prefill engine can serve, prefill on decode instead of 503.",
    )
    late_binding: bool | None = Field(
        default=None,
        description=(
            "Requests wait in the router until an engine has room (prefill: one and a half of "
            "prefill.maxNumBatchedTokens uncached tokens per engine; decode: decode.maxNumSeqs sequences when set), "
            "in a queue fair across clients, and a request that waited maxQueueSeconds is answered 503 with "
            "Retry-After. Off: requests queue in the engines, as vLLM's own scheduler orders them."
        ),
    )


class GatewaySpec(ApiModel):
    """The Gateway API Inference Extension path (`mode: gateway`): an InferencePool whose endpoint picker is pdserve."""

    failure_mode: FailureMode | None = Field(
        default=None,
        description=(
            "What the gateway does when the endpoint picker does not answer: FailOpen sends the request to an "
            "endpoint the gateway chooses itself (decode-only, no PD), FailClose answers 503."
        ),
    )
    sidecar_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description=(
            "Port of the PD sidecar on each decode pod: the InferencePool's target port, where the gateway sends "
            "requests (the sidecar runs prefill when the picker asks for it, then decode on the local engine)."
        ),
    )
    picker_port: int | None = Field(
        default=None, ge=1, le=65535, description="gRPC port of the endpoint picker (Envoy ext_proc and gRPC health)."
    )


class RouterSpec(ApiModel):
    """The PD router: the OpenAI-compatible endpoint in front of the pools."""

    mode: RouterMode | None = Field(
        default=None,
        description=(
            "router: pdserve's router is the OpenAI-compatible endpoint. gateway: a Gateway API Inference "
            "Extension gateway (Istio, GKE, kgateway, ...) is, through the rendered InferencePool; these router pods "
            "run pdserve's endpoint picker instead, and each decode pod gets the PD sidecar."
        ),
    )
    gateway: GatewaySpec | None = Field(default=None, description="Settings of mode gateway.")
    replicas: int | None = Field(default=None, ge=0, le=64, description="Router pods.")
    image: ImageRef | None = Field(default=None, description="Router image.")
    port: int | None = Field(default=None, ge=1, le=65535, description="Service and container port.")
    service_type: ServiceType | None = Field(default=None, description="Router Service type.")
    routing: RoutingSpec | None = Field(default=None, description="Routing policy settings.")
    resources: ComputeResources | None = Field(default=None, description="Router container resources.")
    node_selector: LabelSelectorMap = Field(
        default_factory=dict, description="Node selector for router pods (they need no GPU; CPU nodes are best)."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=MAX_TOLERATIONS, description="Tolerations for router pods."
    )


# ------------------------------------------------------------------------------------------------------------ slo


class SloSpec(ApiModel):
    """Latency objectives the autoscaler keeps: TTFT drives prefill, inter-token latency drives decode."""

    ttft_milliseconds: float | None = Field(default=None, gt=0, description="Time-to-first-token target.")
    itl_milliseconds: float | None = Field(default=None, gt=0, description="Inter-token latency target.")
    percentile: Percentile | None = Field(default=None, description="Percentile the targets apply to.")


class RatioBounds(ApiModel):
    """Bounds of the prefill:decode replica ratio the autoscaler keeps."""

    min: float | None = Field(default=None, gt=0, description="Fewest prefill replicas per decode replica.")
    max: float | None = Field(default=None, gt=0, description="Most prefill replicas per decode replica.")


class ThresholdBounds(ApiModel):
    """Bounds of the disaggregation threshold the autoscaler chooses."""

    min_tokens: int | None = Field(
        default=None, ge=0, description="Lowest threshold: fewest prompts prefilled on decode."
    )
    max_tokens: int | None = Field(
        default=None, ge=0, description="Highest threshold: most prompts prefilled on decode."
    )


class ServiceAutoscalingSpec(ApiModel):
    """Settings of the SLO autoscaler that span both pools (each pool's bounds are in its own autoscaling)."""

    max_gpus: int | None = Field(
        default=None,
        ge=1,
        description=(
            "GPU budget of both engine pools together (replicas x gpusPerPod). The autoscaler never exceeds it: "
            "it rebalances the pools or holds."
        ),
    )
    prefill_to_decode_ratio: RatioBounds | None = Field(
        default=None, description="Bounds of prefill replicas / decode replicas."
    )
    warmup_seconds: int | None = Field(
        default=None,
        ge=0,
        le=3600,
        description=(
            "A pod's latency samples teach the capacity model only after it has been ready this long (first "
            "requests hit cold caches and compilation)."
        ),
    )
    scale_down_stabilization_seconds: int | None = Field(
        default=None,
        ge=0,
        le=3600,
        description="A pool shrinks only to the largest size recommended over this window.",
    )
    burst_memory_seconds: int | None = Field(
        default=None,
        ge=0,
        le=3600,
        description=(
            "A pool never shrinks below what the current load plus the largest burst of this window needs (a "
            "rise to at least triple within one pod start-up): bursty traffic keeps the replicas its next burst "
            "needs on arrival. 0 turns this off."
        ),
    )
    disaggregation_threshold: ThresholdBounds | None = Field(
        default=None,
        description=(
            "Bounds within which the autoscaler moves the router's disaggregation threshold each tick: up (more "
            "prompts prefilled on decode) while prefill is short of capacity and decode's ITL has room for the "
            "longer local prefills, down when decode's ITL nears its target, back to "
            "spec.router.routing.disaggregationThreshold otherwise. It publishes the value to every router replica "
            "(ConfigMap <name>-router-control) and reports it in status.disaggregationThreshold. Absent, or min = "
            "max: the threshold stays as configured."
        ),
    )


# ----------------------------------------------------------------------------------------------------------- spec


class PDServiceSpec(ApiModel):
    """Desired state of a prefill/decode disaggregated model deployment."""

    model: ModelSpec = Field(description="The model being served.")
    engine: EngineSpec = Field(description="Engine settings shared by both pools (they define KV compatibility).")
    prefill: PoolSpec = Field(default_factory=PoolSpec, description="The prefill pool (compute-bound).")
    decode: PoolSpec = Field(default_factory=PoolSpec, description="The decode pool (memory-bandwidth-bound).")
    placement: PlacementSpec | None = Field(default=None, description="Node selection and topology.")
    router: RouterSpec | None = Field(default=None, description="The PD router.")
    slo: SloSpec | None = Field(default=None, description="Latency objectives for autoscaling.")
    autoscaling: ServiceAutoscalingSpec | None = Field(
        default=None, description="Autoscaler settings spanning both pools: GPU budget, P:D ratio, timing."
    )


# --------------------------------------------------------------------------------------------------------- status


class Condition(ApiModel):
    """A metav1.Condition."""

    type: str = Field(
        description=(
            "Condition type: Available, Progressing, Degraded; Ready, Reconciling, Stalled (kstatus, GitOps); "
            "ScalingActive, AbleToScale, ScalingLimited (the SLO autoscaler, while a pool is scaled by pdserve)."
        )
    )
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    observed_generation: int | None = Field(default=None, description="Generation the condition was set for.")
    last_transition_time: str = Field(description="When the status last flipped (RFC 3339).")
    reason: str = Field(description="CamelCase reason.")
    message: str = Field(default="", description="Human-readable details.")


class PoolAutoscalingStatus(ApiModel):
    """What scales one pool, what it decided last and why (pdserve's SLO autoscaler, or an external one)."""

    mode: AutoscalingMode = Field(description="pdserve (the SLO autoscaler) or external (HPA, KEDA).")
    current_replicas: int = Field(default=0, description="Replicas the pool was asked for before the decision.")
    desired_replicas: int = Field(default=0, description="Replicas the decision asked for.")
    reason: str = Field(
        description=(
            "CamelCase reason of the last decision: ScaledUp, ScaledDown, WithinTolerance, ScaleDownStabilizing, "
            "MetricsUnavailable, PodsPending, ScalingInProgress, AtMaxReplicas, AtMinReplicas, BudgetExhausted, "
            "RatioBound, ExternallyScaled, PrometheusNotConfigured, WaitingForMetrics, FailedUpdateScale."
        )
    )
    message: str = Field(default="", description="The numbers behind the decision.")
    metric: Literal["TTFT", "ITL"] = Field(description="The latency this pool is scaled on.")
    percentile: int | None = Field(default=None, description="The SLO percentile the latencies are quantiles at.")
    observed_milliseconds: float | None = Field(
        default=None,
        description=(
            "Client-visible quantile of the metric over the window (the routers' view; the pool's engines' when "
            "the routers saw none, e.g. no streamed answer)."
        ),
    )
    target_milliseconds: float | None = Field(default=None, description="The SLO target of the metric.")
    pool_milliseconds: float | None = Field(
        default=None, description="The pool's own engines' quantile: prefill engine TTFT, decode ITL."
    )
    capacity_per_replica: float | None = Field(
        default=None, description="Load one replica carries within the SLO, estimated (in loadUnit)."
    )
    demand: float | None = Field(default=None, description="Load expected over the next interval (in loadUnit).")
    load_unit: str | None = Field(
        default=None, description="Unit of capacityPerReplica and demand (tokens per second)."
    )
    capacity_basis: Literal["prior", "learned"] | None = Field(
        default=None, description="prior: the engine profile's; learned: fitted from this pool's settled replicas."
    )
    last_scale_time: str | None = Field(default=None, description="When pdserve last changed the replicas (RFC 3339).")


class KvStoreStatus(ApiModel):
    """The KV store the engines use: where its master is and whether it serves."""

    backend: KvStoreBackend = Field(description="Store backend.")
    master_address: str = Field(description="host:port of the master's RPC service, as the engines are told.")
    managed: bool = Field(description="True when pdserve deployed the master (and health-checks it).")
    ready: bool | None = Field(
        default=None,
        description="Whether the deployed master and store server pass their health checks; unset for an external "
        "master, which pdserve does not probe.",
    )
    message: str = Field(default="", description="What is missing while not ready.")


class ThresholdStatus(ApiModel):
    """The disaggregation threshold the routers use, as the autoscaler decided it, and why."""

    tokens: int = Field(description="Uncached prompt tokens at or above which a request goes through prefill.")
    min_tokens: int = Field(description="The lowest value the bounds allow.")
    max_tokens: int = Field(description="The highest value the bounds allow.")
    reason: str = Field(
        description=(
            "CamelCase reason of the last decision: Configured, PrefillShort, DecodeItlAtRisk, NoDecodeHeadroom, "
            "Recovered, Steady, MetricsUnavailable."
        )
    )
    message: str = Field(default="", description="The numbers behind the decision.")
    last_change_time: str | None = Field(default=None, description="When the autoscaler last changed it (RFC 3339).")


class PoolStatus(ApiModel):
    """Observed state of one pool."""

    replicas: int = Field(default=0, description="Pods created by the StatefulSet.")
    ready_replicas: int = Field(default=0, description="Pods ready to serve.")
    desired_replicas: int = Field(default=0, description="Pods wanted (spec or autoscaler).")
    autoscaling: PoolAutoscalingStatus | None = Field(
        default=None, description="While autoscaling is enabled: who scales the pool, its last decision and why."
    )


class InferencePoolParentStatus(ApiModel):
    """One gateway's view of the InferencePool (the pool's `status.parents[]`)."""

    parent: str = Field(description="The parent (usually a Gateway) as kind/namespace/name.")
    accepted: bool = Field(description="The parent's Accepted condition is True.")
    resolved_refs: bool = Field(description="The parent's ResolvedRefs condition is True (the picker was found).")
    message: str = Field(default="", description="The reason and message of the first condition that is not True.")


class InferencePoolStatus(ApiModel):
    """The InferencePool pdserve renders in router mode gateway."""

    name: str = Field(description="The InferencePool's name (inference.networking.k8s.io/v1, same namespace).")
    parents: list[InferencePoolParentStatus] = Field(
        default_factory=list, description="The gateways that reference the pool, with their conditions."
    )


class PDServiceStatus(ApiModel):
    """Observed state, written by the operator."""

    observed_generation: int | None = Field(default=None, description="Last spec generation acted on.")
    conditions: list[Condition] = Field(
        default_factory=list,
        description=(
            "Available, Progressing, Degraded, and kstatus' Ready, Reconciling, Stalled (exactly one of these three is "
            "True: Ready when serving and up to date, Stalled when a human must act, Reconciling otherwise)."
        ),
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    prefill: PoolStatus | None = Field(default=None, description="Prefill pool.")
    decode: PoolStatus | None = Field(default=None, description="Decode pool.")
    router_endpoint: str | None = Field(default=None, description="In-cluster URL of the router's Service.")
    kv_compat_hash: str | None = Field(default=None, description="Hash of what P and D must agree on.")
    kv_store: KvStoreStatus | None = Field(default=None, description="The KV store, when spec.engine.kvCache has one.")
    disaggregation_threshold: ThresholdStatus | None = Field(
        default=None,
        description="While spec.autoscaling.disaggregationThreshold lets it move: the threshold routers use, and why.",
    )
    inference_pool: InferencePoolStatus | None = Field(
        default=None, description="The InferencePool of router mode gateway, and the gateways that accepted it."
    )


class ObjectMeta(ApiModel):
    """The part of metav1.ObjectMeta the renderer uses."""

    model_config = ConfigDict(extra="ignore")

    name: str = Field(
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        pattern=NAME_PATTERN,
        description="Object name; a DNS-1035 label short enough for the names derived from it.",
    )
    namespace: Namespace = Field(default="default", description="Namespace.")
    uid: str | None = Field(default=None, description="Object UID (set by the API server).")
    generation: int | None = Field(default=None, description="Spec generation (set by the API server).")
    labels: dict[str, str] = Field(default_factory=dict, description="Labels.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Annotations.")


class PDService(ApiModel):
    """A prefill/decode disaggregated model deployment."""

    api_version: Literal["pdserve.io/v1alpha1"] = Field(default="pdserve.io/v1alpha1", description="API version.")
    kind: Literal["PDService"] = Field(default="PDService", description="Kind.")
    metadata: ObjectMeta = Field(description="Standard object metadata.")
    spec: PDServiceSpec = Field(description="Desired state.")
    status: PDServiceStatus | None = Field(default=None, description="Observed state.")
