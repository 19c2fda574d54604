"""The process node's Node object and its heartbeat.

Registration creates the Node, or on a restart merges our label and taint into the existing one (taints that
others added, such as the node lifecycle controller's, are kept). The heartbeat renews the node's Lease in
``kube-node-lease`` every 10 s, which is what the node lifecycle controller watches, and refreshes the Ready
condition's lastHeartbeatTime every minute, so the node stays Ready and its pods are never evicted. A Node
that someone deleted is registered again at the next status refresh.
"""

from __future__ import annotations

import logging
import platform
import threading
import time
from datetime import UTC, datetime
from typing import Any

from pdserve_dev.process_node.kube import ApiException, Kube
from pdserve_dev.process_node.podstatus import rfc3339

log = logging.getLogger(__name__)

Obj = dict[str, Any]

LABEL = "pdserve.io/process-node"
TAINT: Obj = {"key": LABEL, "value": "true", "effect": "NoSchedule"}
#: What a pod spec (or a PDService's placement and router) needs to run on the process node: its label, and a
#: toleration of its taint.
SELECTOR: dict[str, str] = {LABEL: "true"}
TOLERATION: Obj = {"key": LABEL, "operator": "Exists", "effect": TAINT["effect"]}
HOST_IP = "127.0.0.1"

# Generous, so the scheduler never runs out of room on the one node that runs real processes.
CAPACITY: dict[str, str] = {
    "cpu": "64",
    "memory": "512Gi",
    "pods": "250",
    "ephemeral-storage": "1Ti",
    "nvidia.com/gpu": "64",
    "rdma/ib": "64",
}

LEASE_SECONDS = 40
RENEW_SECONDS = 10.0
STATUS_SECONDS = 60.0


def node_object(name: str) -> Obj:
    """The Node as first created (status is patched separately)."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                LABEL: "true",
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "process-node",
            },
            "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {"taints": [dict(TAINT)]},
    }


def node_status(name: str, now: float, *, transition: bool = True) -> Obj:
    """Capacity, addresses and conditions of a healthy node.

    Heartbeats pass ``transition=False``: the strategic merge patch then keeps each condition's
    lastTransitionTime and only moves lastHeartbeatTime.
    """
    stamp = rfc3339(now)

    def condition(kind: str, ok: bool, reason: str, message: str) -> Obj:
        entry: Obj = {
            "type": kind,
            "status": "True" if ok else "False",
            "reason": reason,
            "message": message,
            "lastHeartbeatTime": stamp,
        }
        if transition:
            entry["lastTransitionTime"] = stamp
        return entry

    return {
        "capacity": dict(CAPACITY),
        "allocatable": dict(CAPACITY),
        "addresses": [{"type": "InternalIP", "address": HOST_IP}, {"type": "Hostname", "address": name}],
        "conditions": [
            condition("Ready", True, "KubeletReady", "process node is posting ready status"),
            condition("MemoryPressure", False, "KubeletHasSufficientMemory", "process node has memory"),
            condition("DiskPressure", False, "KubeletHasNoDiskPressure", "process node has disk"),
            condition("PIDPressure", False, "KubeletHasSufficientPID", "process node has PIDs"),
        ],
        "nodeInfo": {
            "architecture": "amd64",
            "operatingSystem": "linux",
            "osImage": platform.platform(),
            "kernelVersion": platform.release(),
            "containerRuntimeVersion": "process-node://0.1",
            "kubeletVersion": "v0.0.0-process-node",
            "kubeProxyVersion": "",
            "machineID": "",
            "systemUUID": "",
            "bootID": "",
        },
        "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
    }


def lease_object(name: str, node_uid: str | None) -> Obj:
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    metadata: Obj = {"name": name, "namespace": "kube-node-lease"}
    if node_uid:
        # Owned by the Node, so deleting the Node garbage-collects the Lease, as with real kubelets.
        metadata["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": name, "uid": node_uid}]
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": metadata,
        "spec": {"holderIdentity": name, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": now},
    }


def register(kube: Kube, name: str) -> Obj:
    """Create or update the Node and mark it Ready; return it."""
    existing = kube.read_node(name)
    if existing is None:
        node = kube.create_node(node_object(name))
        log.info("Created Node node=%s", name)
    else:
        taints = list(existing.get("spec", {}).get("taints") or [])
        if not any(t.get("key") == LABEL and t.get("effect") == "NoSchedule" for t in taints):
            taints.append(dict(TAINT))
        wanted = node_object(name)
        node = kube.patch_node(
            name,
            {"metadata": {"labels": wanted["metadata"]["labels"]}, "spec": {"taints": taints, "unschedulable": False}},
        )
        log.info("Updated existing Node node=%s", name)
    kube.patch_node_status(name, node_status(name, time.time()))
    return node


class Heartbeat(threading.Thread):
    """Renews the Lease and the Ready condition until ``stop`` is set; API errors are retried."""

    def __init__(self, kube: Kube, name: str, node_uid: str | None, stop: threading.Event) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self._kube = kube
        self._name = name
        self._node_uid = node_uid
        self._stop = stop

    def run(self) -> None:
        last_status = time.monotonic()
        while not self._stop.is_set():
            try:
                self._kube.renew_lease(lease_object(self._name, self._node_uid))
                if time.monotonic() - last_status >= STATUS_SECONDS:
                    self._refresh_status()
                    last_status = time.monotonic()
            except Exception as exc:  # never let the heartbeat die: the node would go NotReady
                log.warning("Failed to renew node heartbeat node=%s error=%s", self._name, exc)
            self._stop.wait(RENEW_SECONDS)

    def _refresh_status(self) -> None:
        """Move the Ready heartbeat; register the Node again if someone deleted it."""
        try:
            self._kube.patch_node_status(self._name, node_status(self._name, time.time(), transition=False))
        except ApiException as exc:
            if exc.status != 404:
                raise
            log.warning("Node was deleted, registering it again node=%s", self._name)
            node = register(self._kube, self._name)
            self._node_uid = node.get("metadata", {}).get("uid")
