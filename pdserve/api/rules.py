"""The cross-field rules that both the API server (CEL) and `pdserve validate` (Python) enforce: one table.

Each rule is one row: the model it applies to, a CEL expression (defaults it needs are interpolated from
`defaults.py`, never written again here), the Python predicate that means the same, one message naming the fix,
and the field the problem is reported at. `crdgen` turns the rows into `x-kubernetes-validations` on the model's
schema node (with `fieldPath`, so the API server names the same field as `pdserve validate`); `validation.py`
walks a parsed spec and runs the predicate of each row on every object of the row's model, wherever it occurs
(an env var in the engine, a pool or the router; a toleration in placement, a pool or the router).

A rule belongs here when a schema alone cannot say it but CEL can, and Kubernetes must enforce it at admission
(a spec the CRD admits is copied into pod templates, so what a Pod rejects the CRD must reject). Rules CEL cannot
express, or that the CRD should not start enforcing on stored objects, are Python-only and live in `validation.py`.

tests/api/test_rule_agreement.py runs one table of specs through `pdserve validate` and the API server and
asserts they agree, message included.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pdserve.api import hostpaths
from pdserve.api.defaulting import default_of, field_value, resolve
from pdserve.api.defaults import EffectiveAutoscaling, EffectiveEngine, EffectiveGateway, EffectivePool
from pdserve.api.v1alpha1 import (
    ApiModel,
    AutoscalingSpec,
    EnvVar,
    KvStoreSpec,
    ModelSpec,
    MooncakeSpec,
    PDServiceSpec,
    PlacementSpec,
    RatioBounds,
    ThresholdBounds,
    Toleration,
)

M = TypeVar("M", bound=ApiModel)


@dataclass(frozen=True)
class CrossFieldRule(Generic[M]):
    """One rule, in both languages."""

    name: str
    """Short id (tests refer to rules by it)."""
    model: type[M]
    """The object the rule is evaluated on (CEL `self`)."""
    cel: str
    holds: Callable[[M], bool]
    """The Python twin of `cel`: True when the object satisfies the rule."""
    message: str
    field: str
    """Where the problem is, relative to the object, in wire spelling (CEL `fieldPath` without the dot)."""

    def x_kubernetes_validation(self) -> dict[str, str]:
        return {"rule": self.cel, "message": self.message, "fieldPath": f".{self.field}"}


def _cel_literal(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace("'", "\\'")
        return f"'{escaped}'"
    raise TypeError(f"no CEL literal for {value!r}")


def cel_or_default(path: str, value: object) -> str:
    """A CEL expression for `self.<path>`, or `value` when any step of the path is absent."""
    steps = path.split(".")
    guards = " && ".join(f"has(self.{'.'.join(steps[: i + 1])})" for i in range(len(steps)))
    if len(steps) > 1:
        guards = f"({guards})"
    return f"({guards} ? self.{path} : {_cel_literal(value)})"


_MIN, _MAX = default_of(EffectiveAutoscaling, "min_replicas"), default_of(EffectiveAutoscaling, "max_replicas")
_TP = default_of(EffectivePool, "tensor_parallel_size")
_ATTENTION = default_of(EffectiveEngine, "attention")
_ENGINE_PORT = default_of(EffectiveEngine, "port")
_SIDE_CHANNEL_PORT = default_of(EffectiveEngine, "side_channel_port")
_SIDECAR_PORT = default_of(EffectiveGateway, "sidecar_port")


def _bounds_hold(scaling: AutoscalingSpec) -> bool:
    bounds = resolve(EffectiveAutoscaling, scaling)
    return bounds.min_replicas <= bounds.max_replicas


def _cel_list(values: tuple[str, ...]) -> str:
    return "[" + ", ".join(_cel_literal(value) for value in values) + "]"


# A node path in spec.model.uri (hostpaths.py has the why): normalised, and clear of every system path.
_NODE_PATH_NORMALISED = f"!self.uri.startsWith('/') || !self.uri.matches({_cel_literal(hostpaths.UNNORMALISED)})"
_NODE_PATH_NOT_SYSTEM = (
    "!self.uri.startsWith('/') || (self.uri != '/' && "
    f"{_cel_list(hostpaths.SYSTEM_PATHS)}.all(p, self.uri != p && !self.uri.startsWith(p + '/') && "
    "!p.startsWith(self.uri + '/')))"
)


def _tp_pairs(spec: PDServiceSpec) -> bool:
    if field_value(EffectiveEngine, spec.engine, "attention") == "mla":
        return True
    prefill, decode = (field_value(EffectivePool, pool, "tensor_parallel_size") for pool in (spec.prefill, spec.decode))
    return bool(prefill <= decode)


def _sidecar_port_free(spec: PDServiceSpec) -> bool:
    gateway = spec.router.gateway if spec.router is not None else None
    sidecar = field_value(EffectiveGateway, gateway, "sidecar_port")
    engine_ports = (field_value(EffectiveEngine, spec.engine, name) for name in ("port", "side_channel_port"))
    return sidecar not in set(engine_ports)


_SIDECAR_PORT_CEL = cel_or_default("router.gateway.sidecarPort", _SIDECAR_PORT)


RULES: tuple[CrossFieldRule[Any], ...] = (
    CrossFieldRule(
        name="env-value-or-value-from",
        model=EnvVar,
        # Kubernetes rejects a non-empty value beside valueFrom in a pod.
        cel="!has(self.valueFrom) || !has(self.value) || self.value == ''",
        holds=lambda var: var.value_from is None or not var.value,
        message="set value or valueFrom, not both; remove one of them",
        field="valueFrom",
    ),
    CrossFieldRule(
        name="toleration-empty-key-needs-exists",
        model=Toleration,
        cel="(has(self.key) && self.key != '') || (has(self.operator) && self.operator == 'Exists')",
        holds=lambda toleration: bool(toleration.key) or toleration.operator == "Exists",
        message="an empty key needs operator Exists (it then matches every taint); set a key or operator Exists",
        field="operator",
    ),
    CrossFieldRule(
        name="toleration-exists-has-no-value",
        model=Toleration,
        cel="!has(self.operator) || self.operator != 'Exists' || !has(self.value) || self.value == ''",
        holds=lambda toleration: toleration.operator != "Exists" or not toleration.value,
        message="value must be empty when operator is Exists; remove it or use operator Equal",
        field="value",
    ),
    CrossFieldRule(
        name="toleration-seconds-needs-no-execute",
        model=Toleration,
        cel="!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
        holds=lambda toleration: toleration.toleration_seconds is None or toleration.effect == "NoExecute",
        message="tolerationSeconds applies to effect NoExecute only; set effect NoExecute or remove it",
        field="tolerationSeconds",
    ),
    CrossFieldRule(
        name="revision-needs-hf",
        model=ModelSpec,
        cel="!has(self.revision) || self.uri.startsWith('hf://')",
        holds=lambda model: model.revision is None or model.uri.startswith("hf://"),
        message="revision applies to hf:// models only; remove it or use an hf:// uri",
        field="revision",
    ),
    CrossFieldRule(
        name="model-node-path-normalised",
        model=ModelSpec,
        cel=_NODE_PATH_NORMALISED,
        holds=lambda model: not hostpaths.is_node_path(model.uri) or hostpaths.is_normalised(model.uri),
        message=(
            "a node path must be normalised: no '.' or '..' segment, no '//' and no trailing '/'; write the folder "
            "as it is on the node, e.g. /mnt/models/llama"
        ),
        field="uri",
    ),
    CrossFieldRule(
        name="model-node-path-not-system",
        model=ModelSpec,
        cel=_NODE_PATH_NOT_SYSTEM,
        holds=lambda model: not hostpaths.is_node_path(model.uri) or not hostpaths.touches_system_path(model.uri),
        message=(
            "a node path may not be, lie under or contain a system folder (/, /etc, /proc, /sys, /dev, /root, /run, "
            "/var/run, /var/lib/kubelet, /var/lib/rancher, /var/log, /opt/cni, ...; docs/security.md lists them): "
            "the engine image is the author's and would read the node; keep model weights in a folder of their own, "
            "e.g. /mnt/models/llama"
        ),
        field="uri",
    ),
    CrossFieldRule(
        name="autoscaling-min-le-max",
        model=AutoscalingSpec,
        cel=f"{cel_or_default('minReplicas', _MIN)} <= {cel_or_default('maxReplicas', _MAX)}",
        holds=_bounds_hold,
        message=(
            f"minReplicas must be <= maxReplicas (absent, minReplicas is {_MIN} and maxReplicas {_MAX}); "
            "raise maxReplicas or lower minReplicas"
        ),
        field="minReplicas",
    ),
    CrossFieldRule(
        name="ratio-min-le-max",
        model=RatioBounds,
        cel="!has(self.min) || !has(self.max) || self.min <= self.max",
        holds=lambda ratio: ratio.min is None or ratio.max is None or ratio.min <= ratio.max,
        message="min must be <= max; raise max or lower min",
        field="min",
    ),
    CrossFieldRule(
        name="threshold-min-le-max",
        model=ThresholdBounds,
        cel="!has(self.minTokens) || !has(self.maxTokens) || self.minTokens <= self.maxTokens",
        holds=lambda bounds: (
            bounds.min_tokens is None or bounds.max_tokens is None or bounds.min_tokens <= bounds.max_tokens
        ),
        message="minTokens must be <= maxTokens; raise maxTokens or lower minTokens",
        field="minTokens",
    ),
    CrossFieldRule(
        name="store-settings-need-backend",
        model=KvStoreSpec,
        cel="!has(self.mooncake) || has(self.backend)",
        holds=lambda store: store.mooncake is None or store.backend is not None,
        message="mooncake settings take effect only with a store backend; set backend: mooncake or remove them",
        field="backend",
    ),
    CrossFieldRule(
        name="mooncake-metadata-needs-address",
        model=MooncakeSpec,
        cel="!has(self.metadataServer) || has(self.masterAddress)",
        holds=lambda mooncake: mooncake.metadata_server is None or mooncake.master_address is not None,
        message=(
            "metadataServer names an existing master's metadata server; set masterAddress too, or remove it (a "
            "master pdserve deploys serves its own)"
        ),
        field="metadataServer",
    ),
    CrossFieldRule(
        name="mooncake-deployed-settings-without-address",
        model=MooncakeSpec,
        cel="!has(self.masterAddress) || (!has(self.capacityBytes) && !has(self.image))",
        holds=lambda mooncake: (
            mooncake.master_address is None or (mooncake.capacity_bytes is None and mooncake.image is None)
        ),
        message=(
            "capacityBytes and image describe the master and store server pdserve deploys; with masterAddress your "
            "own store servers hold the memory: remove them, or remove masterAddress to let pdserve deploy one"
        ),
        field="masterAddress",
    ),
    CrossFieldRule(
        name="colocation-needs-topology-key",
        model=PlacementSpec,
        # Only a colocation the user wrote needs a key: the default (preferred) without one means no constraint.
        cel="!has(self.colocation) || self.colocation == 'none' || has(self.topologyKey)",
        holds=lambda placement: placement.colocation in (None, "none") or placement.topology_key is not None,
        message=(
            "topologyKey is required when colocation is required or preferred; set it to the label of the shared "
            "domain (e.g. topology.kubernetes.io/zone or a rack label) or use colocation none"
        ),
        field="topologyKey",
    ),
    CrossFieldRule(
        name="prefill-tp-le-decode-tp",
        model=PDServiceSpec,
        # vLLM's NixlConnector maps each decode rank onto a slice of a prefill rank's KV heads: with standard
        # attention prefill TP may not exceed decode TP. MLA replicates the latent KV on every rank.
        cel=(
            f"{cel_or_default('engine.attention', _ATTENTION)} == 'mla' || "
            f"{cel_or_default('prefill.tensorParallelSize', _TP)} <= "
            f"{cel_or_default('decode.tensorParallelSize', _TP)}"
        ),
        holds=_tp_pairs,
        message=(
            "prefill.tensorParallelSize must be <= decode.tensorParallelSize for standard attention (vLLM's "
            f"NixlConnector cannot pair them; an absent tensorParallelSize is {_TP}); lower prefill TP or set "
            "engine.attention to mla for MLA models"
        ),
        field="prefill.tensorParallelSize",
    ),
    CrossFieldRule(
        name="gateway-sidecar-port-free",
        model=PDServiceSpec,
        # The PD sidecar shares the decode pod's network namespace with the engine and its NIXL side channel.
        cel=(
            f"{_SIDECAR_PORT_CEL} != {cel_or_default('engine.port', _ENGINE_PORT)} && "
            f"{_SIDECAR_PORT_CEL} != {cel_or_default('engine.sideChannelPort', _SIDE_CHANNEL_PORT)}"
        ),
        holds=_sidecar_port_free,
        message=(
            "router.gateway.sidecarPort must differ from engine.port and engine.sideChannelPort (the PD sidecar "
            f"shares the decode pod's network; absent, they are {_SIDECAR_PORT}, {_ENGINE_PORT} and "
            f"{_SIDE_CHANNEL_PORT}); choose another sidecarPort"
        ),
        field="router.gateway.sidecarPort",
    ),
)

BY_MODEL: Mapping[type[Any], tuple[CrossFieldRule[Any], ...]] = {
    model: tuple(rule for rule in RULES if rule.model is model) for model in {rule.model for rule in RULES}
}
