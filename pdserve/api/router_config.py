"""The PD router's configuration file: what the renderer writes into the router's ConfigMap and the router reads.

It is part of the shared API because both sides must agree on it: the operator renders it from a PDService and
the router (runtime) parses it. Field names are camelCase in YAML, like every other Kubernetes-facing document.

A setting that is also a PDService field takes its default from the spec's defaults table (`defaults.py`, read
as the view classes' attributes), so a router started from a hand-written file behaves like a rendered one.

Kubernetes discovery reads EndpointSlices and one ConfigMap the operator publishes for it: never Pods (a Pod's spec
carries its env, secrets included, and the router faces clients). What the router pairs and scores on reaches it
through objects the operator controls:
- kv-compat: the operator keeps one headless Service per pool and kv-compat value present among the pool's pods,
  labelled with that value and selecting it; the EndpointSlice controller copies a Service's labels onto its
  slices, so every slice the router selects says which kv-compat value all of its endpoints carry.
- ownership: labels prove nothing (anyone with `edit` in the namespace writes them, on a Service of their own
  too), so the router takes engines only from slices the EndpointSlice controller made (`MANAGED_BY_SLICE_LABEL`;
  `edit` may not write EndpointSlices) for a Service the operator owns: the operator publishes those Services'
  names and UIDs (`OwnedServices`, key `OWNED_SERVICES_KEY`), and a slice's controller reference must carry the
  UID. Of such a slice it takes only endpoints whose pod is a member of the pool's StatefulSet by name
  (`EndpointSelector.statefulset`, `is_member_pod`): a Service selects pods by label, so a pod of anyone's that
  copies the labels would otherwise be listed in the operator's own Services' slices.
- topology: a slice endpoint carries its zone and node name; other node labels (a rack, an NVLink domain) are
  published by the operator, which reads the nodes its engine pods run on (`NodeTopology`, key
  `NODE_TOPOLOGY_KEY`).
Both published documents are keys of the ConfigMap `discoveryConfigMap` names.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from pdserve.api.defaults import EffectiveEngine, EffectiveGateway, EffectiveRouter, EffectiveRouting
from pdserve.api.kvcompat import KV_COMPAT_LABEL

ZONE_LABEL = "topology.kubernetes.io/zone"
HOSTNAME_LABEL = "kubernetes.io/hostname"
SLICE_TOPOLOGY_LABELS = (ZONE_LABEL, HOSTNAME_LABEL)
"""Node labels every EndpointSlice endpoint carries already (as `zone` and `nodeName`)."""
NODE_TOPOLOGY_KEY = "nodes.json"
"""The discovery ConfigMap's key holding a `NodeTopology` as JSON."""
OWNED_SERVICES_KEY = "services.json"
"""The discovery ConfigMap's key holding an `OwnedServices` as JSON."""
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
"""The label the EndpointSlice controller gives every slice it makes: the name of the slice's Service."""
MANAGED_BY_SLICE_LABEL = "endpointslice.kubernetes.io/managed-by"
ENDPOINT_SLICE_CONTROLLER = "endpointslice-controller.k8s.io"
"""The `MANAGED_BY_SLICE_LABEL` value of the slices the EndpointSlice controller makes (it overwrites both labels
if a Service sets them)."""
ROUTER_CONTROL_KEY = "control.json"
"""The router control ConfigMap's one key (its value is a `RouterControl` as JSON)."""
_ORDINAL = re.compile(r"0|[1-9][0-9]*")


def is_member_pod(pod_name: str, statefulset: str) -> bool:
    """Whether `pod_name` is one a StatefulSet named `statefulset` gives its pods: `<statefulset>-<ordinal>`."""
    prefix = f"{statefulset}-"
    return pod_name.startswith(prefix) and _ORDINAL.fullmatch(pod_name[len(prefix) :]) is not None


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class KvEventsPortNames(_Model):
    """The EndpointSlice port names of one engine publisher's KV events (vLLM's --kv-events-config endpoints)."""

    events: str = Field(min_length=1, description="Port name of the ZMQ publisher (`endpoint`).")
    replay: str | None = Field(default=None, description="Port name of the replay socket (`replay_endpoint`).")


class KvEventsEndpoints(_Model):
    """One engine publisher's KV event endpoints (static discovery), as ZMQ addresses."""

    endpoint: str = Field(pattern=r"^tcp://\S+:\d+$", description="The publisher, e.g. tcp://10.0.0.5:5557.")
    replay_endpoint: str | None = Field(
        default=None, pattern=r"^tcp://\S+:\d+$", description="Its replay socket, e.g. tcp://10.0.0.5:5657."
    )


class EndpointSelector(_Model):
    """Which EndpointSlices hold one pool's engines (Kubernetes discovery mode)."""

    namespace: str = Field(description="Namespace of the pool's EndpointSlices.")
    label_selector: str = Field(
        min_length=1,
        description="Label selector of the pool's EndpointSlices. A slice's `kvCompatLabel` label is the kv-compat "
        "value of all its endpoints (slices without it pair only with each other); the renderer selects the slices "
        "of the pool's per-kv-compat Services.",
    )
    port_name: str = Field(default="http", description="Name of the engine's HTTP port in the EndpointSlice.")
    statefulset: str | None = Field(
        default=None,
        description="The pool's StatefulSet: only endpoints whose pod is one of its members (`<statefulset>-<n>`) "
        "are taken (unset: any pod of the selected slices).",
    )
    kv_events_ports: list[KvEventsPortNames] = Field(
        default_factory=list,
        description="The engines' KV event ports by name in the EndpointSlice, one entry per data-parallel rank "
        "(empty: the engines publish no KV events and the router tracks prefixes itself).",
    )


class DiscoveryConfigMap(_Model):
    """The ConfigMap the operator publishes for the router: the Services it owns and the nodes' topology labels."""

    namespace: str = Field(description="Namespace of the ConfigMap.")
    name: str = Field(min_length=1, description="Name of the ConfigMap (the router may read only this one).")


class NodeTopology(_Model):
    """The discovery ConfigMap's `nodes.json`: written by the operator, read by the router."""

    nodes: dict[str, dict[str, str]] = Field(
        default_factory=dict, description="Node name -> topology label -> value, for the nodes engines run on."
    )


class OwnedServices(_Model):
    """The discovery ConfigMap's `services.json`: the Services the operator owns whose EndpointSlices hold engines."""

    services: dict[str, str] = Field(
        default_factory=dict,
        description="Service name -> its UID. A slice is trusted only when its Service is listed here and its "
        "controller reference carries that UID.",
    )


class RouterControlSource(_Model):
    """The ConfigMap the autoscaler publishes the router's controls in (`RouterControl`)."""

    namespace: str = Field(description="Namespace of the ConfigMap.")
    name: str = Field(min_length=1, description="Name of the ConfigMap (the router may read only this one).")
    owner_uid: str | None = Field(
        default=None,
        description="UID of the PDService whose controller reference the ConfigMap must carry (the operator "
        "renders it): a ConfigMap of that name that anyone else made is ignored, so a namespace user with ConfigMap "
        "rights cannot move the threshold. None: any ConfigMap of that name (a router configured by hand).",
    )


class RouterControl(_Model):
    """The content of the router control ConfigMap (key `control.json`), applied by every router replica as soon as
    it sees it, without a restart: the disaggregation threshold the operator's autoscaler decided (issue 19: the PD
    threshold is an output) and the service's TTFT target (`spec.slo`, which therefore never rolls the routers).
    A member absent, or the whole ConfigMap absent or malformed: the router uses its configured value
    (`policy.disaggregationThresholdTokens`, `admission.ttftTargetSeconds`). Unknown members are ignored, so the
    operator may publish more controls before every router reads them."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True)

    disaggregation_threshold: int | None = Field(
        default=None, ge=0, description="Uncached prompt tokens at or above which a request goes through prefill."
    )
    ttft_target_seconds: float | None = Field(
        default=None, gt=0, description="The service's time-to-first-token target (`admission.ttftTargetSeconds`)."
    )
    reason: str = Field(default="", max_length=1024, description="Why the autoscaler chose it (for logs).")
    decided_at: str = Field(default="", max_length=64, description="When it was decided (RFC 3339).")


class RouterPeers(_Model):
    """Where a router replica finds the other replicas of its PDService: its own Service's EndpointSlices."""

    namespace: str = Field(description="Namespace of the router Service's EndpointSlices.")
    label_selector: str = Field(
        min_length=1,
        description="Label selector of those slices (`kubernetes.io/service-name=<service>`); their ready "
        "endpoints are the router replicas that share every engine's budget.",
    )


class AdmissionConfig(_Model):
    """Late binding (issue 19): requests wait in the router until an engine has room, in a bounded queue fair
    across clients; a request that can no longer be served in a useful time is told so (429/503, Retry-After)."""

    prefill_budget_tokens: int = Field(
        default=0,
        ge=0,
        description="Uncached prompt tokens one prefill engine may hold (queued or prefilling), across every router "
        "replica; a request waits in the router until an engine has room for it (a prompt larger than a replica's "
        "share goes to an engine that holds nothing of that replica). About one and a half of the engine's "
        "max_num_batched_tokens keeps it at full steps with nothing more waiting there (0: unbounded, requests "
        "queue in the engines).",
    )
    decode_budget_sequences: int = Field(
        default=0,
        ge=0,
        description="Sequences one decode engine may run, across every router replica (its max_num_seqs); a PD "
        "request reserves its decode sequence before prefill starts (0: unbounded).",
    )
    max_queued_requests: int = Field(
        default=2048,
        ge=1,
        description="Requests waiting in this router replica at once; when full, a client holding its fair share "
        "of the queue (this bound over the clients waiting) is refused 429, and one within it takes the place of "
        "the newest request of the client holding the most (that one is answered 429).",
    )
    max_queue_seconds: float = Field(
        default=15.0,
        gt=0,
        description="Longest a request waits for an engine with room; then it is answered 503 with Retry-After "
        "(it could no longer meet a useful deadline). The request's own deadline (requestTimeoutSeconds, 504) "
        "ends the wait if it comes first.",
    )
    ttft_target_seconds: float | None = Field(
        default=None,
        gt=0,
        description="The service's time-to-first-token target: requests that can still meet it go before those "
        "that no longer can, so a burst beyond capacity makes its excess late rather than everyone (unset: fair "
        "order only).",
    )
    router_replicas: int = Field(
        default=1,
        ge=1,
        description="Router replicas sharing the engines (each takes a budget divided by this); with `peers`, the "
        "ready replicas found there replace it once read.",
    )
    client_header: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9-]+$",
        description="A request header naming the client for fair queueing, set by a trusted proxy in front of the "
        "router (a client could forge it otherwise). Unset: the Authorization header (hashed), else the peer "
        "address.",
    )
    peers: RouterPeers | None = Field(
        default=None,
        description="Where the other router replicas are found (kubernetes discovery; the renderer names the "
        "router Service's EndpointSlices).",
    )


class RoutingPolicyConfig(_Model):
    """How the router decides, per request, between the PD path and decode-only."""

    disaggregation_threshold_tokens: int = Field(
        default=EffectiveRouting.disaggregation_threshold,
        ge=0,
        description="Prompts whose estimated uncached tokens are at or above this go through prefill.",
    )
    prefix_aware: bool = Field(
        default=EffectiveRouting.prefix_aware, description="Score engines by the prompt prefix they likely hold."
    )
    block_size_tokens: int = Field(
        default=EffectiveEngine.block_size, ge=1, description="Token block size used for prefix hashing."
    )
    fallback_to_decode: bool = Field(
        default=EffectiveRouting.fallback_to_decode,
        description="When no prefill engine can serve, let a decode engine prefill locally.",
    )
    max_prefill_attempts: int = Field(default=2, ge=1, description="Prefill tries per request, across engines.")
    max_decode_attempts: int = Field(default=2, ge=1, description="Decode tries per request, across engines.")
    decode_load_weight: float = Field(
        default=1.0, ge=0, description="Weight of the in-flight load score when choosing a decode engine."
    )
    decode_prefix_weight: float = Field(
        default=1.0, ge=0, description="Weight of the prefix-affinity score when choosing a decode engine."
    )
    prefill_load_weight: float = Field(
        default=1.0,
        ge=0,
        description="Weight of the in-flight prefill tokens score when choosing a prefill engine.",
    )
    prefill_prefix_weight: float = Field(
        default=1.0, ge=0, description="Weight of the prefix-affinity score when choosing a prefill engine."
    )
    prefill_topology_weight: float = Field(
        default=0.5,
        ge=0,
        description="Weight of sharing the decode engine's topology domain when choosing a prefill engine.",
    )
    kv_headroom_weight: float = Field(
        default=0.5,
        ge=0,
        description="Weight of engine-reported KV-cache headroom (vllm:kv_cache_usage_perc) when choosing a decode "
        "engine; needs engineMetricsIntervalSeconds > 0.",
    )
    kv_events: bool = Field(
        default=True,
        description="Follow the KV events of engines that publish them (an index per engine that every router "
        "replica shares through the engines) and route on what they say; engines without events fall back to the "
        "router's own prefix tracking.",
    )
    kv_store: bool = Field(
        default=False,
        description="The engines share a KV store that prefill writes every prompt into (spec.engine.kvCache.store): "
        "a decode failure after prefill is retried on a decode engine without prefill's kv_transfer_params, which "
        "loads the prompt from the store, instead of with a new prefill; and a prompt prefilled once counts as held "
        "by every engine, at storeTierWeight.",
    )
    cpu_tier_weight: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="What a prefix in an engine's CPU offload tier is worth relative to one in its GPU cache (1).",
    )
    store_tier_weight: float = Field(
        default=0.25,
        ge=0,
        le=1,
        description="What a prefix in the shared KV store is worth relative to one in an engine's GPU cache (1).",
    )
    prefix_cache_ttl_seconds: float = Field(
        default=600.0, gt=0, description="How long the router assumes an engine keeps a prompt block cached."
    )
    prefix_tracker_max_blocks: int = Field(
        default=200_000,
        ge=1,
        description="Bound on the prompt blocks the router remembers, across engines (prompt text counted at 4 "
        "bytes per token: the default keeps about 12.8 MB of prompts); also the bound of each engine's KV-event "
        "index.",
    )


class CircuitBreakerConfig(_Model):
    """When an engine is ejected from routing after failures, and how it is probed back in."""

    failure_threshold: int = Field(
        default=3,
        ge=1,
        description="Consecutive failures (connect errors, 5xx, timeouts) that eject an engine.",
    )
    open_seconds: float = Field(default=5.0, gt=0, description="How long an ejected engine is left alone.")
    probe_interval_seconds: float = Field(
        default=1.0, gt=0, description="How often ejected engines are probed on their health path."
    )
    success_threshold: int = Field(
        default=1, ge=1, description="Consecutive successful probes that bring an ejected engine back."
    )
    health_path: str = Field(
        default="/health", pattern=r"^/", description="Engine path probed while an engine is ejected."
    )
    max_ejected_percent: int = Field(
        default=50,
        ge=0,
        le=100,
        description="Most engines of a pool ejected at once, in percent of the pool (rounded down, but one engine "
        "of a pool of two or more may always be ejected). The last usable engine of a pool is never ejected: "
        "errors alone never leave a pool empty.",
    )


class PickerConfig(_Model):
    """The endpoint picker's own settings (`pdserve picker` flags; the rest of its configuration is the router's)."""

    grpc_port: int = Field(
        default=EffectiveGateway.picker_port, ge=1, le=65535, description="ext_proc and gRPC health port."
    )
    link_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description=(
            "Loopback port of the link the relay (pdserve-picker-relay, beside the picker in its pod) sends "
            "ext_proc messages over; 0: no link (the gateway talks to the picker's gRPC port itself)."
        ),
    )
    target_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description=(
            "Port the gateway sends a request to on the chosen decode pod (the PD sidecar's); absent: the decode "
            "engine's own port from discovery (no sidecar, decode-only)."
        ),
    )
    fallback_endpoints: int = Field(
        default=0,
        ge=0,
        le=8,
        description=(
            "Further decode endpoints listed after the pick, in the scheduler's order, for gateways that retry "
            "down the list (Envoy's override_host policy); 0 for gateways whose ORIGINAL_DST cluster takes one "
            "address from the header."
        ),
    )
    max_in_flight_per_decode: int = Field(
        default=0,
        ge=0,
        description="Shed (429) when every usable decode engine has this many requests in flight; 0 never sheds.",
    )


class RouterConfig(_Model):
    """The router's whole configuration."""

    served_model_name: str = Field(description="The model name clients send; also what /v1/models lists.")
    host: str = Field(default="0.0.0.0", description="Listen address.")
    port: int = Field(default=EffectiveRouter.port, ge=1, le=65535, description="Listen port.")
    metrics_port: int = Field(
        default=9090,
        ge=0,
        le=65535,
        description="Port of the router's Prometheus `/metrics`, apart from the client port: the metrics name every "
        "engine and its load, which anonymous clients must not read (0: any free port, logged).",
    )
    discovery: Literal["kubernetes", "static"] = Field(default="kubernetes", description="How engines are found.")
    prefill: EndpointSelector | None = Field(default=None, description="Prefill pool (kubernetes discovery).")
    decode: EndpointSelector | None = Field(default=None, description="Decode pool (kubernetes discovery).")
    static_prefill: list[str] = Field(default_factory=list, description="Prefill engine URLs (static discovery).")
    static_decode: list[str] = Field(default_factory=list, description="Decode engine URLs (static discovery).")
    static_kv_events: dict[str, list[KvEventsEndpoints]] = Field(
        default_factory=dict,
        description="Static discovery: each engine URL's KV event publishers (one per data-parallel rank).",
    )
    static_health_interval_seconds: float = Field(
        default=1.0,
        ge=0,
        description="Static discovery: seconds between reads of each engine's health path (circuitBreaker.healthPath). "
        "An engine answering anything but 200 (vLLM's 503 while it drains on SIGTERM) takes no new requests until "
        "it answers 200 again; one that does not answer is left to the circuit breaker (0: off).",
    )
    kv_compat_label: str = Field(
        default=KV_COMPAT_LABEL,
        description="EndpointSlice label holding the kv-compat value of the slice's engines (the pods' label of the "
        "same name, copied from their per-kv-compat Service); a prefill and a decode engine pair only when their "
        "values are equal.",
    )
    topology_labels: list[str] = Field(
        default_factory=lambda: [ZONE_LABEL],
        description="Node labels that name a topology domain (zone, rack, NVLink domain); a prefill engine in the "
        f"decode engine's domain is preferred. {ZONE_LABEL} and {HOSTNAME_LABEL} come from the EndpointSlices, "
        "others from the discovery ConfigMap.",
    )
    discovery_config_map: DiscoveryConfigMap | None = Field(
        default=None,
        description="Where the operator publishes the Services it owns (only their EndpointSlices are trusted: the "
        "pools have no engine until it is read) and the topology labels EndpointSlices do not carry (kubernetes "
        "discovery). Unset (a hand-written configuration): every slice the selectors select is trusted, and only "
        "the slices' zone and node name are known.",
    )
    policy: RoutingPolicyConfig = Field(default_factory=RoutingPolicyConfig, description="Routing policy.")
    request_timeout_seconds: float = Field(
        default=600.0,
        gt=0,
        description="Deadline of one request, end to end: then the client gets 504 (or an error event mid-stream) "
        "and no engine is counted as failed (a long generation is not an engine fault).",
    )
    connect_timeout_seconds: float = Field(default=2.0, gt=0, description="TCP connect timeout to an engine.")
    first_byte_timeout_seconds: float = Field(
        default=30.0,
        gt=0,
        description="Longest wait for an engine's first byte of a prefill answer or of a stream (queueing and "
        "prefill included); then the engine counts as failed and another one is tried. Non-streaming answers, "
        "where an engine is silent until done, are bounded by requestTimeoutSeconds only.",
    )
    read_timeout_seconds: float = Field(
        default=120.0,
        gt=0,
        description="Longest silence between two chunks of a stream from an engine (a stalled stream is ended).",
    )
    max_request_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024, description="Request body size limit.")
    max_request_header_bytes: int = Field(
        default=16 * 1024,
        ge=1024,
        description="Limit on a request's line and headers together; a larger request gets 431.",
    )
    header_timeout_seconds: float = Field(
        default=10.0,
        gt=0,
        description="Longest time from a request's first byte to the end of its headers; then the connection is "
        "closed (slow header attacks).",
    )
    body_timeout_seconds: float = Field(
        default=30.0,
        gt=0,
        description="Longest time to receive a request's whole body after its headers; then the client gets 408.",
    )
    keep_alive_timeout_seconds: float = Field(
        default=75.0, gt=0, description="How long an idle client connection is kept open between requests."
    )
    max_connections: int = Field(
        default=4096,
        ge=1,
        description="Client connections served at once; a connection beyond it gets 503 and is closed.",
    )
    max_buffered_body_bytes: int = Field(
        default=512 * 1024 * 1024,
        ge=1024,
        description="Request bodies held in memory at once, across clients (while received and while proxied); a "
        "request beyond it gets 503 with Retry-After.",
    )
    max_buffered_body_bytes_per_client: int = Field(
        default=64 * 1024 * 1024,
        ge=1024,
        description="The same bound per client address, so that one client cannot take the whole of "
        "maxBufferedBodyBytes (slow uploads); a request beyond it gets 429. Bodies are charged as their bytes "
        "arrive (headers announcing a large body cost nothing), and when a bound is reached, bodies still arriving "
        "that trickle (minBodyBytesPerSecond) or hold more than their fair share give way to new ones. Behind a "
        "proxy or SNAT every client shares one address: set it to maxBufferedBodyBytes there.",
    )
    min_body_bytes_per_second: float = Field(
        default=64 * 1024,
        ge=0,
        description="A request body arriving slower than this (averaged over the last second) while memory is "
        "short loses its place to others (408): a trickling upload cannot hold its share for the whole "
        "bodyTimeoutSeconds.",
    )
    max_chunk_metadata_bytes: int = Field(
        default=4096,
        ge=0,
        description="Chunk extensions and trailers allowed in one chunked request body (they are read and dropped); "
        "beyond it the client gets 400.",
    )
    client_write_timeout_seconds: float = Field(
        default=30.0,
        gt=0,
        description="Longest time a client may leave an answer unread (its socket and the router's bounded write "
        "buffer full); then its connection is closed and its engine request aborted. The engine's health is not "
        "touched: while a client does not read, the engine's silence is not counted against it.",
    )
    max_prefill_answer_bytes: int = Field(
        default=1024 * 1024,
        ge=1024,
        description="Largest prefill answer accepted (its kv_transfer_params go to a decode engine); a larger one "
        "counts as the prefill engine failing.",
    )
    kv_side_channel_ports: list[int] = Field(
        default_factory=list,
        description="Ports a prefill engine may name as its KV side channel (remote_port in its answer); empty: any "
        "port number. The remote host must always be an address of the prefill engine the router chose. The "
        "renderer lists the prefill pool's: vLLM's NixlConnector listens on VLLM_NIXL_SIDE_CHANNEL_PORT plus the "
        "data-parallel rank.",
    )
    shutdown_grace_seconds: float = Field(
        default=20.0,
        ge=0,
        description="On SIGTERM: stop accepting, then let answers under way finish for up to this long (keep it "
        "below the pod's terminationGracePeriodSeconds).",
    )
    engine_metrics_interval_seconds: float = Field(
        default=2.0,
        ge=0,
        description="Seconds between scrapes of the decode engines' /metrics for KV-cache usage (0: off).",
    )
    retry_after_seconds: int = Field(
        default=2, ge=1, description="Retry-After sent with 503 answers when no engine can serve."
    )
    circuit_breaker: CircuitBreakerConfig = Field(
        default_factory=CircuitBreakerConfig, description="Ejection of failing engines."
    )
    admission: AdmissionConfig = Field(
        default_factory=AdmissionConfig, description="Late binding: engine budgets, the router's queue, shedding."
    )
    router_control: RouterControlSource | None = Field(
        default=None,
        description="The ConfigMap the operator's autoscaler publishes controls in (`RouterControl`: the "
        "disaggregation threshold); watched, applied at once; absent or malformed: policy's static threshold.",
    )

    @model_validator(mode="after")
    def _discovery_has_its_inputs(self) -> RouterConfig:
        """Fail at load time, not at the first request, when the chosen discovery mode lacks its inputs."""
        if self.metrics_port == self.port:
            raise ValueError(f"metricsPort must differ from port ({self.port}): metrics are not served to clients")
        if self.discovery == "kubernetes" and self.decode is None:
            raise ValueError("discovery=kubernetes needs a decode selector (prefill is optional)")
        if self.discovery == "static":
            if not self.static_decode:
                raise ValueError("discovery=static needs at least one staticDecode URL")
            for url in [*self.static_prefill, *self.static_decode]:
                if not url.startswith(("http://", "https://")):
                    raise ValueError(f"engine URL {url!r} must start with http:// or https://")
        return self
