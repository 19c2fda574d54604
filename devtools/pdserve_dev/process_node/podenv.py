"""A container's environment, resolved the way the kubelet resolves it.

Order (later wins): ``envFrom`` sources in order, then ``env`` entries in order. Each ``env[].value`` is
``$(VAR)``-expanded against the variables defined before it in the same container; ``valueFrom`` values
(downward API, configMap/secret keys, resource fields) are used verbatim. The result is what command and args
are expanded against. A missing configMap, secret or key that is not marked optional raises
:class:`ContainerConfigError`, which the caller reports as ``CreateContainerConfigError`` and retries.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Protocol

from kubernetes.utils import parse_quantity

from pdserve_dev.process_node.expansion import expand

Obj = dict[str, Any]

_LABEL_OR_ANNOTATION = re.compile(r"^metadata\.(labels|annotations)\['(.+)'\]$")


class ContainerConfigError(Exception):
    """The container's configuration refers to something that does not exist (yet)."""


class ObjectLookup(Protocol):
    """Read access to the configMaps and secrets a pod refers to (None when the object does not exist)."""

    def configmap_data(self, namespace: str, name: str) -> dict[str, str] | None: ...

    def secret_data(self, namespace: str, name: str) -> dict[str, str] | None: ...


@dataclass(frozen=True)
class PodAddresses:
    """The addresses the downward API exposes."""

    pod_ip: str
    host_ip: str


def field_ref(pod: Obj, path: str, addresses: PodAddresses) -> str:
    """Resolve a downward-API ``fieldPath`` against ``pod``."""
    meta = pod.get("metadata", {})
    spec = pod.get("spec", {})
    simple: dict[str, str] = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": addresses.pod_ip,
        "status.podIPs": addresses.pod_ip,
        "status.hostIP": addresses.host_ip,
        "status.hostIPs": addresses.host_ip,
    }
    if path in simple:
        return simple[path]
    match = _LABEL_OR_ANNOTATION.match(path)
    if match:
        kind, key = match.groups()
        return str((meta.get(kind) or {}).get(key, ""))
    raise ContainerConfigError(f"unsupported downward API fieldPath {path!r}")


def resource_field_ref(pod: Obj, container: Obj, ref: Obj, allocatable: Mapping[str, str]) -> str:
    """Resolve a ``resourceFieldRef`` (``limits.cpu``, ``requests.memory``, ...), rounded up by the divisor.

    A missing limit falls back to the node's allocatable amount, as in Kubernetes.
    """
    name = ref.get("containerName") or container.get("name", "")
    target = next((c for c in pod.get("spec", {}).get("containers", []) if c.get("name") == name), container)
    kind, _, resource = str(ref.get("resource", "")).partition(".")
    if kind not in ("limits", "requests") or not resource:
        raise ContainerConfigError(f"unsupported resourceFieldRef resource {ref.get('resource')!r}")
    resources = target.get("resources") or {}
    raw = (resources.get(kind) or {}).get(resource)
    if raw is None and kind == "requests":
        raw = (resources.get("limits") or {}).get(resource)
    if raw is None:
        raw = allocatable.get(resource, "0")
    value: Decimal = parse_quantity(str(raw))  # type: ignore[no-untyped-call]
    divisor: Decimal = parse_quantity(str(ref.get("divisor", "1")))  # type: ignore[no-untyped-call]
    return str(math.ceil(value / divisor))


def _key_ref(namespace: str, ref: Obj, data: dict[str, str] | None, kind: str) -> str | None:
    """The value of a configMapKeyRef/secretKeyRef, None when optional and missing."""
    name, key, optional = ref.get("name", ""), ref.get("key", ""), bool(ref.get("optional", False))
    if data is None:
        if optional:
            return None
        raise ContainerConfigError(f'{kind} "{name}" not found in namespace "{namespace}"')
    if key not in data:
        if optional:
            return None
        raise ContainerConfigError(f"couldn't find key {key} in {kind} {namespace}/{name}")
    return data[key]


def container_env(
    pod: Obj,
    container: Obj,
    addresses: PodAddresses,
    lookup: ObjectLookup,
    allocatable: Mapping[str, str],
) -> dict[str, str]:
    """Return the environment the container's spec defines (not including the host's or the image's)."""
    namespace = pod.get("metadata", {}).get("namespace", "default")
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        if "configMapRef" in source:
            ref, kind = source["configMapRef"], "configmap"
            data = lookup.configmap_data(namespace, ref.get("name", ""))
        elif "secretRef" in source:
            ref, kind = source["secretRef"], "secret"
            data = lookup.secret_data(namespace, ref.get("name", ""))
        else:
            continue
        if data is None:
            if ref.get("optional"):
                continue
            raise ContainerConfigError(f'{kind} "{ref.get("name")}" not found in namespace "{namespace}"')
        env.update({prefix + key: value for key, value in data.items()})
    for entry in container.get("env") or []:
        name = entry["name"]
        if "valueFrom" not in entry:
            env[name] = expand(str(entry.get("value", "")), env)
            continue
        source = entry["valueFrom"]
        value: str | None
        if "fieldRef" in source:
            value = field_ref(pod, source["fieldRef"].get("fieldPath", ""), addresses)
        elif "resourceFieldRef" in source:
            value = resource_field_ref(pod, container, source["resourceFieldRef"], allocatable)
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            data = lookup.configmap_data(namespace, ref.get("name", ""))
            value = _key_ref(namespace, ref, data, "configmap")
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            data = lookup.secret_data(namespace, ref.get("name", ""))
            value = _key_ref(namespace, ref, data, "secret")
        else:
            raise ContainerConfigError(f"unsupported valueFrom in env {name!r}")
        if value is not None:
            env[name] = value
    return env


def expand_command(container: Obj, env: Mapping[str, str]) -> tuple[list[str] | None, list[str] | None]:
    """The container's command and args with ``$(VAR)`` expanded; None where the spec leaves them out.

    An empty list counts as left out, as in Kubernetes (the fields are ``omitempty``).
    """
    command = container.get("command") or None
    args = container.get("args") or None
    return (
        [expand(str(word), env) for word in command] if command else None,
        [expand(str(word), env) for word in args] if args else None,
    )
