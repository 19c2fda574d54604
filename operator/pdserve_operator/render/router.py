"""The router: Deployment, Service, ConfigMap (its RouterConfig), ServiceAccount, Role and RoleBinding.

The router discovers engines itself and reads nothing but what the operator publishes for it: EndpointSlices
(the pools' per-kv-compat Services, whose labels say which kv-compat value their engines carry, and its own
Service's, whose ready endpoints are the router replicas sharing every engine's budget), the one discovery
ConfigMap (the Services the operator owns, the nodes' topology labels) and the router control ConfigMap (the
autoscaler's disaggregation threshold). Its Role is exactly that: list and watch EndpointSlices in its namespace,
and list and watch those two ConfigMaps by name; no Pods (their env would be readable by an internet-facing
process), no Services, no Nodes, no Secrets. It never gets a single object (every read is a list + watch), so no
`get`.
The router serves Prometheus `/metrics` on a port of its own, named `metrics` on the container (the PodMonitor
scrapes it there), never on the client port: the metrics name every engine and its load. The client Service
publishes only the client port (a LoadBalancer Service would otherwise put the metrics on the internet).
A hash of the rendered config is a pod annotation: changing routing settings rolls the router pods, which is
simpler and more predictable than hot reload. The discovery and router control ConfigMaps change as Services and
pods come and go and as the autoscaler decides: they are watched, not mounted, so they never roll the router (nor
does the router replica count, which the routers read from their Service).
"""

from __future__ import annotations

import hashlib
from typing import Any

import yaml

from pdserve.api.defaults import EffectiveSpec
from pdserve.api.router_config import (
    ROUTER_CONTROL_KEY,
    AdmissionConfig,
    DiscoveryConfigMap,
    EndpointSelector,
    RouterConfig,
    RouterControl,
    RouterControlSource,
    RouterPeers,
    RoutingPolicyConfig,
)
from pdserve.api.v1alpha1 import PDService
from pdserve_operator.names import child_name, labels, router_control_name, selector_labels
from pdserve_operator.render import discovery
from pdserve_operator.render.containers import RESTRICTED_NON_ROOT, http_probes, router_scheduling
from pdserve_operator.render.objects import metadata

CONFIG_KEY = "router.yaml"
CONFIG_DIR = "/etc/pdserve"
CONFIG_HASH_ANNOTATION = "pdserve.io/config-hash"
# Not user settings: the router drains in-flight streams within this, and its pods spread one per node.
TERMINATION_GRACE_SECONDS = 30
_SPREAD_KEY = "kubernetes.io/hostname"
# The router's metrics port (the next one when the client port is this one), and its container port's name.
METRICS_PORT = 9090
METRICS_PORT_NAME = "metrics"
# vLLM's max_num_batched_tokens when the spec leaves it to vLLM (its default for the OpenAI server on GPUs of 70 GiB
# or more); the prefill budget is one and a half of it: a full step running, most of the next one ready, nothing
# more waiting in the engine (what a request arriving behind a burst waits for).
VLLM_MAX_NUM_BATCHED_TOKENS = 8192
# The label the EndpointSlice controller puts on every slice of a Service.
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def metrics_port(spec: EffectiveSpec) -> int:
    """Where the router serves /metrics: METRICS_PORT, unless the client port is that (then the next one)."""
    return METRICS_PORT if spec.router.port != METRICS_PORT else METRICS_PORT + 1


def router_endpoint(pds: PDService, spec: EffectiveSpec) -> str:
    """The in-cluster URL clients use; reported in status.routerEndpoint."""
    service = child_name(pds, "router")
    return f"http://{service}.{pds.metadata.namespace}.svc:{spec.router.port}"


def admission(pds: PDService, spec: EffectiveSpec) -> AdmissionConfig:
    """Late binding (`routing.lateBinding`): budgets from the pools' engine limits, the replicas from the Service.
    Off, both budgets are 0: the gate lets every request through to the engines. The deadlines' TTFT target is
    published in the router control ConfigMap (`control_config_map`), not here: a change of `spec.slo` reaches the
    routers without rolling them."""
    late = spec.router.routing.late_binding
    step = spec.prefill.max_num_batched_tokens or VLLM_MAX_NUM_BATCHED_TOKENS
    return AdmissionConfig(
        prefill_budget_tokens=step * 3 // 2 if late else 0,
        # Only when the spec states it: a guess below the engine's own limit would cap decode throughput.
        decode_budget_sequences=(spec.decode.max_num_seqs or 0) if late else 0,
        peers=RouterPeers(
            namespace=pds.metadata.namespace, label_selector=f"{SERVICE_NAME_LABEL}={child_name(pds, 'router')}"
        ),
    )


def router_config(pds: PDService, spec: EffectiveSpec) -> RouterConfig:
    routing = spec.router.routing
    namespace = pds.metadata.namespace
    return RouterConfig(
        served_model_name=spec.model.name,
        port=spec.router.port,
        metrics_port=metrics_port(spec),
        discovery="kubernetes",
        prefill=EndpointSelector(
            namespace=namespace,
            label_selector=discovery.slice_selector(pds, "prefill"),
            statefulset=child_name(pds, "prefill"),
            kv_events_ports=discovery.kv_events_selector_ports(spec, "prefill"),
        ),
        decode=EndpointSelector(
            namespace=namespace,
            label_selector=discovery.slice_selector(pds, "decode"),
            statefulset=child_name(pds, "decode"),
            kv_events_ports=discovery.kv_events_selector_ports(spec, "decode"),
        ),
        topology_labels=discovery.topology_labels(spec),
        discovery_config_map=DiscoveryConfigMap(namespace=namespace, name=discovery.discovery_config_map_name(pds)),
        kv_side_channel_ports=discovery.side_channel_ports(spec),
        policy=RoutingPolicyConfig(
            disaggregation_threshold_tokens=routing.disaggregation_threshold,
            prefix_aware=routing.prefix_aware,
            block_size_tokens=spec.engine.block_size,
            fallback_to_decode=routing.fallback_to_decode,
            kv_store=spec.engine.kv_cache.store.enabled,
        ),
        admission=admission(pds, spec),
        router_control=RouterControlSource(
            namespace=namespace, name=router_control_name(pds), owner_uid=pds.metadata.uid
        ),
    )


def config_text(pds: PDService, spec: EffectiveSpec) -> str:
    document = router_config(pds, spec).model_dump(by_alias=True, mode="json")
    return yaml.safe_dump(document, sort_keys=True)


def config_map(pds: PDService, spec: EffectiveSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(pds, child_name(pds, "router"), "router"),
        "data": {CONFIG_KEY: config_text(pds, spec)},
    }


def control_config_map(pds: PDService, spec: EffectiveSpec, observed: discovery.Observed) -> dict[str, Any] | None:
    """The router control ConfigMap (`<name>-router-control`, key control.json), what every router replica applies
    without a restart: the TTFT target of `spec.slo`, and, while the spec lets the autoscaler choose the
    disaggregation threshold (spec.autoscaling.disaggregationThreshold with lowest < highest), what it decided last
    (`observed.router_control`), else the configured threshold kept within the bounds. None when there is neither:
    the routers use their configured threshold, and a ConfigMap published before is pruned."""
    configured, low, high = spec.disaggregation_threshold_bounds()
    ttft = spec.slo.ttft_milliseconds
    control: RouterControl | None = None
    if low < high:
        control = observed.router_control or RouterControl(
            disaggregation_threshold=max(low, min(high, configured)),
            reason="the configured threshold: the autoscaler has not decided yet",
        )
        decided = control.disaggregation_threshold
        if decided is None or not low <= decided <= high:
            # Decided under other bounds (the spec changed since): never publish outside the ones the spec sets now.
            kept = max(low, min(high, configured if decided is None else decided))
            control = control.model_copy(
                update={
                    "disaggregation_threshold": kept,
                    "reason": f"{control.reason} (kept within [{low}, {high}])"[:1024],
                }
            )
    if ttft is None and control is None:
        return None
    control = (control or RouterControl()).model_copy(update={"ttft_target_seconds": ttft / 1000 if ttft else None})
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(pds, router_control_name(pds), "router"),
        "data": {ROUTER_CONTROL_KEY: control.model_dump_json(by_alias=True, exclude_none=True)},
    }


def service_account(pds: PDService) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": metadata(pds, child_name(pds, "router"), "router"),
        "automountServiceAccountToken": True,
    }


def role(pds: PDService, spec: EffectiveSpec) -> dict[str, Any]:
    """What the router reads (list, then watch), and nothing else: EndpointSlices (the engines' and its own
    Service's, for the other router replicas), the discovery ConfigMap and the router control ConfigMap."""
    watch = ["list", "watch"]
    rules: list[dict[str, Any]] = [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": watch}]
    names = [discovery.discovery_config_map_name(pds), router_control_name(pds)]
    # A list or watch is authorised against resourceNames when it selects metadata.name (the router does).
    rules.append({"apiGroups": [""], "resources": ["configmaps"], "resourceNames": names, "verbs": watch})
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": metadata(pds, child_name(pds, "router"), "router"),
        "rules": rules,
    }


def role_binding(pds: PDService) -> dict[str, Any]:
    name = child_name(pds, "router")
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": metadata(pds, name, "router"),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": pds.metadata.namespace}],
    }


def deployment(pds: PDService, spec: EffectiveSpec) -> dict[str, Any]:
    router = spec.router
    name = child_name(pds, "router")
    container: dict[str, Any] = {
        "name": "router",
        "image": router.image,
        "command": ["pdserve", "router"],
        "args": ["--config", f"{CONFIG_DIR}/{CONFIG_KEY}"],
        "env": [{"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}],
        "ports": [
            {"name": "http", "containerPort": router.port, "protocol": "TCP"},
            {"name": METRICS_PORT_NAME, "containerPort": metrics_port(spec), "protocol": "TCP"},
        ],
        "resources": router.resources.as_dict(),
        **http_probes("http"),
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}],
        "securityContext": dict(RESTRICTED_NON_ROOT),
    }
    config_hash = hashlib.sha256(config_text(pds, spec).encode()).hexdigest()[:16]
    pod_spec: dict[str, Any] = {
        "serviceAccountName": name,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
        "containers": [container],
        "volumes": [{"name": "config", "configMap": {"name": name}}],
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": _SPREAD_KEY,
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": selector_labels(pds, "router")},
            }
        ],
    }
    pod_spec.update(router_scheduling(router))
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(pds, name, "router"),
        "spec": {
            "replicas": router.replicas,
            "selector": {"matchLabels": selector_labels(pds, "router")},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {
                    "labels": labels(pds, "router"),
                    "annotations": {CONFIG_HASH_ANNOTATION: config_hash},
                },
                "spec": pod_spec,
            },
        },
    }


def service(pds: PDService, spec: EffectiveSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(pds, child_name(pds, "router"), "router"),
        "spec": {
            "type": spec.router.service_type,
            "selector": selector_labels(pds, "router"),
            "ports": [{"name": "http", "port": spec.router.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def disruption_budget(pds: PDService) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(pds, child_name(pds, "router"), "router"),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(pds, "router")}},
    }
