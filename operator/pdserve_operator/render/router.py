"""The router: Deployment, Service, ConfigMap (its RouterConfig), ServiceAccount, Role and RoleBinding.

The router discovers engines itself (EndpointSlices of the pools' headless Services, plus Pods for their
kv-compat and topology labels), so its Role grants read access to exactly those two resources in its namespace.
A hash of the rendered config is a pod annotation: changing routing settings rolls the router pods, which is
simpler and more predictable than hot reload.
"""

from __future__ import annotations

import hashlib
from typing import Any

import yaml

from pdserve.api import defaults
from pdserve.api.router_config import EndpointSelector, RouterConfig, RoutingPolicyConfig
from pdserve.api.v1alpha1 import PDService, RouterSpec, RoutingSpec
from pdserve_operator.render.names import child_name, labels, selector_labels
from pdserve_operator.render.objects import metadata

CONFIG_KEY = "router.yaml"
CONFIG_DIR = "/etc/pdserve"
CONFIG_HASH_ANNOTATION = "pdserve.io/config-hash"


def _router(pds: PDService) -> RouterSpec:
    return pds.spec.router or RouterSpec()


def router_port(pds: PDService) -> int:
    return _router(pds).port or defaults.ROUTER_PORT


def router_endpoint(pds: PDService) -> str:
    """The in-cluster URL clients use; reported in status.routerEndpoint."""
    service = child_name(pds, "router")
    return f"http://{service}.{pds.metadata.namespace}.svc:{router_port(pds)}"


def router_config(pds: PDService) -> RouterConfig:
    routing = _router(pds).routing or RoutingSpec()
    namespace = pds.metadata.namespace
    topology = [pds.spec.placement.topology_key] if pds.spec.placement and pds.spec.placement.topology_key else []
    return RouterConfig(
        served_model_name=pds.spec.model.name,
        port=router_port(pds),
        discovery="kubernetes",
        prefill=EndpointSelector(namespace=namespace, service_name=child_name(pds, "prefill")),
        decode=EndpointSelector(namespace=namespace, service_name=child_name(pds, "decode")),
        topology_labels=topology or ["topology.kubernetes.io/zone"],
        policy=RoutingPolicyConfig(
            disaggregation_threshold_tokens=(
                defaults.DISAGGREGATION_THRESHOLD
                if routing.disaggregation_threshold is None
                else routing.disaggregation_threshold
            ),
            prefix_aware=defaults.PREFIX_AWARE if routing.prefix_aware is None else routing.prefix_aware,
            block_size_tokens=pds.spec.engine.block_size or defaults.BLOCK_SIZE,
            fallback_to_decode=(
                defaults.FALLBACK_TO_DECODE if routing.fallback_to_decode is None else routing.fallback_to_decode
            ),
        ),
    )


def config_text(pds: PDService) -> str:
    document = router_config(pds).model_dump(by_alias=True, mode="json")
    return yaml.safe_dump(document, sort_keys=True)


def config_map(pds: PDService) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(pds, child_name(pds, "router"), "router"),
        "data": {CONFIG_KEY: config_text(pds)},
    }


def service_account(pds: PDService) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": metadata(pds, child_name(pds, "router"), "router"),
        "automountServiceAccountToken": True,
    }


def role(pds: PDService) -> dict[str, Any]:
    read = ["get", "list", "watch"]
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": metadata(pds, child_name(pds, "router"), "router"),
        "rules": [
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": read},
            {"apiGroups": [""], "resources": ["pods"], "verbs": read},
        ],
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


def deployment(pds: PDService) -> dict[str, Any]:
    spec = _router(pds)
    name = child_name(pds, "router")
    resources = (
        spec.resources.model_dump(by_alias=True, exclude_defaults=True)
        if spec.resources
        else {"requests": {"cpu": "1", "memory": "512Mi"}, "limits": {"memory": "2Gi"}}
    )
    probe_port = "http"
    container: dict[str, Any] = {
        "name": "router",
        "image": spec.image or defaults.ROUTER_IMAGE,
        "command": ["pdserve", "router"],
        "args": ["--config", f"{CONFIG_DIR}/{CONFIG_KEY}"],
        "env": [{"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}],
        "ports": [{"name": "http", "containerPort": router_port(pds), "protocol": "TCP"}],
        "resources": resources,
        "readinessProbe": {
            "httpGet": {"path": "/ready", "port": probe_port},
            "periodSeconds": 2,
            "failureThreshold": 2,
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": probe_port},
            "periodSeconds": 10,
            "failureThreshold": 3,
        },
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "runAsUser": 65532,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    config_hash = hashlib.sha256(config_text(pds).encode()).hexdigest()[:16]
    pod_spec: dict[str, Any] = {
        "serviceAccountName": name,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": defaults.ROUTER_TERMINATION_GRACE_SECONDS,
        "containers": [container],
        "volumes": [{"name": "config", "configMap": {"name": name}}],
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": selector_labels(pds, "router")},
            }
        ],
    }
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in spec.tolerations]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(pds, name, "router"),
        "spec": {
            "replicas": defaults.ROUTER_REPLICAS if spec.replicas is None else spec.replicas,
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


def service(pds: PDService) -> dict[str, Any]:
    spec = _router(pds)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(pds, child_name(pds, "router"), "router"),
        "spec": {
            "type": spec.service_type or defaults.ROUTER_SERVICE_TYPE,
            "selector": selector_labels(pds, "router"),
            "ports": [{"name": "http", "port": router_port(pds), "targetPort": "http", "protocol": "TCP"}],
        },
    }


def disruption_budget(pds: PDService) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(pds, child_name(pds, "router"), "router"),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(pds, "router")}},
    }
