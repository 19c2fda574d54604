"""The PD router's configuration file: what the renderer writes into the router's ConfigMap and the router reads.

It is part of the shared API because both sides must agree on it: the operator renders it from a PDService and
the router (runtime) parses it. Field names are camelCase in YAML, like every other Kubernetes-facing document.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class EndpointSelector(_Model):
    """Which EndpointSlices hold one pool's engines (Kubernetes discovery mode)."""

    namespace: str = Field(description="Namespace of the pool's Service and EndpointSlices.")
    service_name: str = Field(
        description="Name of the pool's Service; its EndpointSlices carry kubernetes.io/service-name=<name>."
    )
    port_name: str = Field(default="http", description="Name of the engine's HTTP port in the EndpointSlice.")


class RoutingPolicyConfig(_Model):
    """How the router decides, per request, between the PD path and decode-only."""

    disaggregation_threshold_tokens: int = Field(
        default=256,
        ge=0,
        description="Prompts whose estimated uncached tokens are at or above this go through prefill.",
    )
    prefix_aware: bool = Field(default=True, description="Score engines by the prompt prefix they likely hold.")
    block_size_tokens: int = Field(default=16, ge=1, description="Token block size used for prefix hashing.")
    fallback_to_decode: bool = Field(
        default=True, description="When no prefill engine can serve, let a decode engine prefill locally."
    )
    max_prefill_attempts: int = Field(default=2, ge=1, description="Prefill tries per request, across engines.")
    max_decode_attempts: int = Field(default=2, ge=1, description="Decode tries per request, across engines.")


class RouterConfig(_Model):
    """The router's whole configuration."""

    served_model_name: str = Field(description="The model name clients send; also what /v1/models lists.")
    host: str = Field(default="0.0.0.0", description="Listen address.")
    port: int = Field(default=8080, ge=1, le=65535, description="Listen port.")
    discovery: Literal["kubernetes", "static"] = Field(default="kubernetes", description="How engines are found.")
    prefill: EndpointSelector | None = Field(default=None, description="Prefill pool (kubernetes discovery).")
    decode: EndpointSelector | None = Field(default=None, description="Decode pool (kubernetes discovery).")
    static_prefill: list[str] = Field(default_factory=list, description="Prefill engine URLs (static discovery).")
    static_decode: list[str] = Field(default_factory=list, description="Decode engine URLs (static discovery).")
    kv_compat_label: str = Field(
        default="pdserve.io/kv-compat",
        description="Pod label whose value must match between a prefill and a decode engine to pair them.",
    )
    topology_labels: list[str] = Field(
        default_factory=lambda: ["topology.kubernetes.io/zone"],
        description="Node/pod topology labels used to prefer a prefill engine in the decode engine's domain.",
    )
    policy: RoutingPolicyConfig = Field(default_factory=RoutingPolicyConfig, description="Routing policy.")
    request_timeout_seconds: float = Field(default=600.0, gt=0, description="Upper bound on one request.")
    connect_timeout_seconds: float = Field(default=2.0, gt=0, description="TCP connect timeout to an engine.")
    max_request_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024, description="Request body size limit.")
