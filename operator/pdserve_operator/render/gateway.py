"""Router mode gateway: the InferencePool, the endpoint picker (EPP) and the PD sidecar of each decode pod.

With `spec.router.mode: gateway`, a Gateway API Inference Extension gateway (Istio, GKE, kgateway, ...) is the
OpenAI-compatible endpoint, and pdserve supplies what the extension asks of a model server platform:

- an `InferencePool` (inference.networking.k8s.io/v1) named like the PDService: its selector is the decode pods
  of the current kv-compat value, its target port the PD sidecar's, and its `endpointPickerRef` the picker's
  Service on the gRPC port, with the PDService's failure mode;
- the picker: the router's own objects (ServiceAccount, Role, RoleBinding, ConfigMap, PodDisruptionBudget) with
  the Deployment running `pdserve picker` instead of `pdserve router` (its own settings as flags: its pod-local
  gRPC and link ports and the decode pods' target port) and, beside it, `pdserve-picker-relay` (Go), which serves
  the gateway's ext_proc streams on the picker port and hands the picker only what it decides from (Python's gRPC
  would cost a millisecond a message on the time to first token). Its Role is the router's least-privilege
  one (list/watch EndpointSlices, the one discovery ConfigMap): the picker discovers engines exactly as the
  router does. Its Service exposes the gRPC port (appProtocol `kubernetes.io/h2c`, which gateways read as
  cleartext HTTP/2) and the HTTP port of `/metrics`;
- the PD sidecar, a second container of each decode pod (`pdserve sidecar`, the router's image), listening on
  `sidecarPort` and sending to the engine at the pod's IP. It is ready when its engine is (`/ready`).

Why the router's names and role label: the picker is this PDService's router component in another shape, and
status, drift and the PDB read it under those names. The renderer stays pure: these functions transform the
objects `render.router` and `render.engine` produce.
"""

from __future__ import annotations

import copy
from typing import Any

from pdserve.api.defaults import EffectiveSpec
from pdserve.api.kvcompat import KV_COMPAT_LABEL, kv_compat_hash
from pdserve.api.v1alpha1 import PDService
from pdserve_operator.names import child_name, selector_labels
from pdserve_operator.render import discovery, router
from pdserve_operator.render.containers import RESTRICTED_NON_ROOT, http_probes
from pdserve_operator.render.objects import metadata

INFERENCE_POOL_API_VERSION = "inference.networking.k8s.io/v1"
SIDECAR_CONTAINER = "pd-sidecar"
RELAY_CONTAINER = "relay"
SIDECAR_PORT_NAME = "pd-sidecar"
GRPC_PORT_NAME = "grpc"
# The appProtocol Gateway API implementations read as "cleartext HTTP/2" (GEP-1911); ext_proc is gRPC over it.
H2C_APP_PROTOCOL = "kubernetes.io/h2c"


def enabled(spec: EffectiveSpec) -> bool:
    return spec.router.mode == "gateway"


def inference_pool_name(pds: PDService) -> str:
    """The InferencePool's name: the PDService's, so an HTTPRoute's backendRef names the model service itself."""
    return pds.metadata.name


def inference_pool(pds: PDService, spec: EffectiveSpec) -> dict[str, Any]:
    gateway = spec.router.gateway
    meta = metadata(pds, inference_pool_name(pds), "decode")
    return {
        "apiVersion": INFERENCE_POOL_API_VERSION,
        "kind": "InferencePool",
        "metadata": meta,
        "spec": {
            # Only decode pods of the current kv-compat value: a gateway whose picker fails open must not land on
            # a pod from before a change of what prefill and decode must agree on.
            "selector": {"matchLabels": {**selector_labels(pds, "decode"), KV_COMPAT_LABEL: kv_compat_hash(spec)}},
            "targetPorts": [{"number": gateway.sidecar_port}],
            "appProtocol": "http",
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": child_name(pds, "router"),
                "port": {"number": gateway.picker_port},
                "failureMode": gateway.failure_mode,
            },
        },
    }


def internal_ports(spec: EffectiveSpec) -> tuple[int, int]:
    """The picker's own gRPC port (health, read by the relay) and its link port: pod-local, the first two from 9003
    that no other port of the pod takes."""
    taken = {spec.router.gateway.picker_port, spec.router.port, router.metrics_port(spec)}
    free = (port for port in range(9003, 65536) if port not in taken)
    return next(free), next(free)


def relay_container(spec: EffectiveSpec, picker_grpc: int, link: int) -> dict[str, Any]:
    """`pdserve-picker-relay`: the gateway's ext_proc streams on the picker's port, relayed to the picker's link.

    It answers what needs no decision (response headers and bodies, the request body's echo) and serves the
    extension's gRPC health: liveness its own, readiness the picker's."""
    port = spec.router.gateway.picker_port
    return {
        "name": RELAY_CONTAINER,
        "image": spec.router.image,
        "command": ["pdserve-picker-relay"],
        "args": [
            f"--listen=:{port}",
            f"--picker-link=:{link}",  # no host: the pod's own (loopback)
            f"--picker-grpc=:{picker_grpc}",
        ],
        # One scheduler thread: every message is a short hop, and Go's idle threads spinning for work between
        # them cost more than they save (measured: 24 % less CPU at 64 streams on 2 cores, bench/router_results.md).
        "env": [{"name": "GOMAXPROCS", "value": "1"}],
        "ports": [{"name": GRPC_PORT_NAME, "containerPort": port, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"memory": "512Mi"}},
        # The extension's health services: liveness while the relay runs, readiness while the picker can pick.
        "readinessProbe": {"grpc": {"port": port, "service": "readiness"}, "periodSeconds": 2, "failureThreshold": 2},
        "livenessProbe": {"grpc": {"port": port, "service": "liveness"}, "periodSeconds": 10, "failureThreshold": 3},
        "securityContext": dict(RESTRICTED_NON_ROOT),
    }


def picker_deployment(pds: PDService, spec: EffectiveSpec) -> dict[str, Any]:
    """The router's Deployment running `pdserve picker` beside `pdserve-picker-relay`, which takes the gRPC port."""
    obj = copy.deepcopy(router.deployment(pds, spec))
    pod = obj["spec"]["template"]["spec"]
    container = pod["containers"][0]
    container["name"] = "picker"
    container["command"] = ["pdserve", "picker"]
    # Its own settings are flags (the ConfigMap is the router's, shared as is): decode pods are reached on the
    # sidecar's port; the relay reaches it on pod-local ports.
    picker_grpc, link = internal_ports(spec)
    container["args"] = [
        *container["args"],
        "--grpc-port",
        str(picker_grpc),
        "--link-port",
        str(link),
        "--target-port",
        str(spec.router.gateway.sidecar_port),
    ]
    container.update(http_probes("http"))
    pod["containers"].append(relay_container(spec, picker_grpc, link))
    return obj


def picker_service(pds: PDService, spec: EffectiveSpec) -> dict[str, Any]:
    obj = router.service(pds, spec)
    obj["spec"]["type"] = "ClusterIP"  # the gateway is the entry point; the picker is never exposed
    obj["spec"]["ports"] = [
        {
            "name": GRPC_PORT_NAME,
            "port": spec.router.gateway.picker_port,
            "targetPort": GRPC_PORT_NAME,
            "protocol": "TCP",
            "appProtocol": H2C_APP_PROTOCOL,
        },
        {"name": "http", "port": spec.router.port, "targetPort": "http", "protocol": "TCP"},
    ]
    return obj


def sidecar_container(spec: EffectiveSpec) -> dict[str, Any]:
    """The PD sidecar of a decode pod: the router's PD flow, planned by the picker's `x-prefiller-host-port`."""
    gateway, engine = spec.router.gateway, spec.engine
    args = ["--port", str(gateway.sidecar_port), "--decode", f"http://$(POD_IP):{engine.port}"]
    for port in discovery.side_channel_ports(spec):
        args += ["--kv-side-channel-port", str(port)]
    return {
        "name": SIDECAR_CONTAINER,
        "image": spec.router.image,
        "command": ["pdserve", "sidecar"],
        "args": args,
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        ],
        "ports": [{"name": SIDECAR_PORT_NAME, "containerPort": gateway.sidecar_port, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        **http_probes(SIDECAR_PORT_NAME),
        "securityContext": dict(RESTRICTED_NON_ROOT),
    }


def with_sidecar(statefulset: dict[str, Any], spec: EffectiveSpec) -> dict[str, Any]:
    """The decode StatefulSet with the PD sidecar beside the engine."""
    obj = copy.deepcopy(statefulset)
    obj["spec"]["template"]["spec"]["containers"].append(sidecar_container(spec))
    return obj


def objects(pds: PDService, spec: EffectiveSpec, rendered: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`rendered` (router mode's objects) turned into gateway mode's: the picker in place of the router, the
    sidecar in the decode StatefulSet, and the InferencePool last (it refers to the picker's Service)."""
    router_name, decode_name = child_name(pds, "router"), child_name(pds, "decode")
    out: list[dict[str, Any]] = []
    for obj in rendered:
        kind, name = obj["kind"], obj["metadata"]["name"]
        replaced = obj
        if name == router_name and kind == "Deployment":
            replaced = picker_deployment(pds, spec)
        elif name == router_name and kind == "Service":
            replaced = picker_service(pds, spec)
        elif name == decode_name and kind == "StatefulSet":
            replaced = with_sidecar(obj, spec)
        out.append(replaced)
    out.append(inference_pool(pds, spec))
    return out
