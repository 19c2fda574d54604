"""The few Kubernetes API calls the process node makes, on plain JSON dicts.

The official client's generated models are skipped (``_preload_content=False`` and ``json.loads``): the
process node reads and writes a handful of fields, and dicts keep that code close to the YAML people know.
The sync client is thread-safe (one urllib3 pool), so the watch, the heartbeat and every pod worker share it.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from pdserve.api.kubeclient import new_api_client
from pdserve_dev.process_node.volumes import decode_secret

Obj = dict[str, Any]

__all__ = ["ApiException", "Kube"]

_STRATEGIC = "application/strategic-merge-patch+json"


def _json(response: Any) -> Obj:
    data: Obj = json.loads(response.data)
    return data


class Kube:
    """API access for one process node."""

    def __init__(self, kubeconfig: str) -> None:
        # Every pod worker patches status on its own thread; a pool smaller than that churns connections.
        self.api_client: Any = new_api_client(kubeconfig, pool_size=64)
        # Typed as Any: every call here passes dicts and reads raw responses, which the generated stubs
        # (typed for models) do not describe.
        self.core: Any = client.CoreV1Api(self.api_client)
        self.coordination: Any = client.CoordinationV1Api(self.api_client)

    # --- pods -------------------------------------------------------------------------------------------
    def list_pods(self, node_name: str) -> tuple[list[Obj], str]:
        """The pods bound to ``node_name`` and the list's resourceVersion."""
        result = _json(
            self.core.list_pod_for_all_namespaces(
                field_selector=f"spec.nodeName={node_name}", _preload_content=False, _request_timeout=30
            )
        )
        return list(result.get("items") or []), str(result["metadata"]["resourceVersion"])

    def watch_pods(self, node_name: str, resource_version: str, timeout: int) -> Iterator[Obj]:
        """Raw watch events (``{"type", "object"}``) from ``resource_version`` for at most ``timeout`` s."""
        response = self.core.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={node_name}",
            watch=True,
            resource_version=resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=timeout,
            _preload_content=False,
            _request_timeout=(10, timeout + 15),
        )
        try:
            for line in iter_resp_lines(response):  # type: ignore[no-untyped-call]
                if line:
                    event: Obj = json.loads(line)
                    yield event
        finally:
            response.close()
            response.release_conn()

    def patch_pod_status(self, namespace: str, name: str, status: Obj, uid: str | None = None) -> Obj:
        """Patch a pod's status; with `uid`, only if the pod of that name still is that incarnation.

        As the kubelet does (`statusutil.PatchPodStatus`): the UID in the patch is a precondition, and the API
        server refuses it (409) for another pod of the same name. Without it, the worker of a force-deleted pod
        that reports once more before it notices the deletion writes its own address into the status of the
        StatefulSet's replacement (same name, new UID), whose own reports then fail ("may specify no more than
        one IP for each IP family") and which never turns Ready.
        """
        body: Obj = {"status": status}
        if uid is not None:
            body["metadata"] = {"uid": uid}
        return _json(
            self.core.patch_namespaced_pod_status(
                name,
                namespace,
                body,
                _content_type=_STRATEGIC,
                _preload_content=False,
                _request_timeout=30,
            )
        )

    def delete_pod_now(self, namespace: str, name: str, uid: str) -> None:
        """Delete the pod object with grace period 0, only if it still is the pod with ``uid``."""
        body = client.V1DeleteOptions(grace_period_seconds=0, preconditions=client.V1Preconditions(uid=uid))
        try:
            self.core.delete_namespaced_pod(name, namespace, body=body, _preload_content=False, _request_timeout=30)
        except ApiException as exc:
            # Gone already (404) or replaced by a new pod of the same name (409): nothing left to do.
            if exc.status not in (404, 409):
                raise

    # --- configMaps and secrets -------------------------------------------------------------------------
    def configmap_data(self, namespace: str, name: str) -> dict[str, str] | None:
        try:
            obj = _json(
                self.core.read_namespaced_config_map(name, namespace, _preload_content=False, _request_timeout=30)
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        data = dict(obj.get("data") or {})
        for key, value in (obj.get("binaryData") or {}).items():
            data[key] = base64.b64decode(value).decode("utf-8", errors="replace")
        return data

    def secret_data(self, namespace: str, name: str) -> dict[str, str] | None:
        try:
            obj = _json(self.core.read_namespaced_secret(name, namespace, _preload_content=False, _request_timeout=30))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return decode_secret(obj.get("data") or {})

    # --- service account tokens and the `kubernetes` Service ----------------------------------------------
    def request_token(
        self,
        namespace: str,
        service_account: str,
        *,
        audience: str | None,
        expiration_seconds: int,
        pod_name: str,
        pod_uid: str,
    ) -> tuple[str, float]:
        """A TokenRequest for the ServiceAccount, bound to the pod; returns the token and its expiry (epoch s)."""
        spec: Obj = {
            "expirationSeconds": expiration_seconds,
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": pod_name, "uid": pod_uid},
        }
        if audience:
            spec["audiences"] = [audience]
        result = _json(
            self.core.create_namespaced_service_account_token(
                service_account,
                namespace,
                {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
                _preload_content=False,
                _request_timeout=30,
            )
        )
        status = result["status"]
        expires = datetime.fromisoformat(str(status["expirationTimestamp"]).replace("Z", "+00:00")).timestamp()
        return str(status["token"]), expires

    def read_service(self, namespace: str, name: str) -> Obj | None:
        try:
            response = self.core.read_namespaced_service(name, namespace, _preload_content=False, _request_timeout=30)
            return _json(response)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    @property
    def server(self) -> str:
        """The API server URL this client talks to (from the node's kubeconfig)."""
        return str(self.api_client.configuration.host)

    # --- the node and its lease -------------------------------------------------------------------------
    def read_node(self, name: str) -> Obj | None:
        try:
            return _json(self.core.read_node(name, _preload_content=False, _request_timeout=30))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def create_node(self, node: Obj) -> Obj:
        return _json(self.core.create_node(node, _preload_content=False, _request_timeout=30))

    def patch_node(self, name: str, patch: Obj) -> Obj:
        return _json(
            self.core.patch_node(name, patch, _content_type=_STRATEGIC, _preload_content=False, _request_timeout=30)
        )

    def patch_node_status(self, name: str, status: Obj) -> Obj:
        return _json(
            self.core.patch_node_status(
                name, {"status": status}, _content_type=_STRATEGIC, _preload_content=False, _request_timeout=30
            )
        )

    def renew_lease(self, lease: Obj) -> None:
        """Create or update the node's Lease in kube-node-lease."""
        namespace, name = lease["metadata"]["namespace"], lease["metadata"]["name"]
        try:
            self.coordination.patch_namespaced_lease(
                name,
                namespace,
                {"spec": lease["spec"]},
                _content_type="application/merge-patch+json",
                _preload_content=False,
                _request_timeout=30,
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            self.coordination.create_namespaced_lease(namespace, lease, _preload_content=False, _request_timeout=30)

    # --- events -----------------------------------------------------------------------------------------
    def record_event(self, pod: Obj, *, kind: str, reason: str, message: str, container: str, node: str) -> None:
        """Post a core/v1 Event about ``pod`` as the kubelet would (so `kubectl describe` shows it)."""
        meta = pod["metadata"]
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        involved: Obj = {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": meta["name"],
            "namespace": meta.get("namespace", "default"),
            "uid": meta.get("uid"),
        }
        if container:
            involved["fieldPath"] = f"spec.containers{{{container}}}"
        event: Obj = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": involved["namespace"]},
            "involvedObject": involved,
            "reason": reason,
            "message": message[:1024],
            "type": kind,
            "source": {"component": "kubelet", "host": node},
            "reportingComponent": "kubelet",
            "reportingInstance": node,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        self.core.create_namespaced_event(involved["namespace"], event, _preload_content=False, _request_timeout=10)
