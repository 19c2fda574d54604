"""The IO layer: the few Kubernetes API calls the reconciler makes, each counted and timed out.

It speaks raw REST through the official client's ApiClient (auth and TLS come from the library; which kubeconfig
or service account is used is `pdserve.api.kubeclient`'s one order) rather than the typed or dynamic clients: the
dynamic client would need discovery requests, and the typed client cannot send `application/apply-patch+yaml`.
Every call goes through `_request`, which counts it in Prometheus (the `OperatorMetrics` the runner hands in) and in
`self.requests` (for tests and the benchmark), and applies connect/read timeouts.

Writes go through `_write`, which first asks the leader guard: a replica that is not (or no longer) the leader
raises `NotLeaderError` instead of writing, so two replicas never both act.
"""

from __future__ import annotations

import collections
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from kubernetes import client as k8s

from pdserve_operator.kinds import EVENT, NODE, PDSERVICE, Kind, kind_of
from pdserve_operator.metrics import OperatorMetrics

FIELD_MANAGER = "pdserve-operator"
# The SLO autoscaler's writes to a pool's /scale: a manager of their own, so `kubectl get sts -o yaml
# --show-managed-fields` tells who set the replicas, and the operator's apply (FIELD_MANAGER) co-owns the field
# without taking it back (see plan.py).
AUTOSCALER_FIELD_MANAGER = "pdserve-autoscaler"
# (connect, read) seconds for every request; applies of big StatefulSets still finish in well under a second.
REQUEST_TIMEOUT = (5.0, 30.0)
log = logging.getLogger("pdserve.operator.kube")


class ApiError(Exception):
    """A non-2xx answer from the API server, with its status code and the server's message."""

    def __init__(self, code: int, message: str, reason: str = "") -> None:
        self.code = code
        self.reason = reason
        super().__init__(f"HTTP {code} {reason}: {message}")

    @property
    def not_found(self) -> bool:
        return self.code == 404

    @property
    def conflict(self) -> bool:
        return self.code == 409

    @property
    def retriable(self) -> bool:
        """Server-side trouble or throttling: retry with backoff. 4xx other than 409/429 means a bad request."""
        return self.code in (0, 409, 429) or self.code >= 500


class NotLeaderError(Exception):
    """Raised instead of writing when this replica does not hold the leader Lease."""


class KubeIO(Protocol):
    """The writes a reconcile (and the autoscaler's loop) makes, and the one read a reconcile needs besides its
    cache (`read`: whether a child's name is free): the seam between them and the API server.

    `KubeApi` implements it over HTTP. The reconcile unit tests implement it in memory
    (`pdserve_dev.testing.fake_kube.FakeKube`); the contract both keep: every write raises `NotLeaderError` (and
    sends nothing) once this replica is not the leader, and API failures raise `ApiError` with the HTTP status code
    (0 for a connection failure), while `post_event` logs and swallows them (events are advisory)."""

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]: ...

    def read(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None: ...

    def delete(self, kind: Kind, namespace: str, name: str, uid: str) -> None: ...

    def patch_status(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]: ...

    def post_event(self, involved: dict[str, Any], type_: str, reason: str, message: str, now: str) -> None: ...

    def scale(self, kind: Kind, namespace: str, name: str, replicas: int) -> dict[str, Any]: ...


@dataclass
class Response:
    code: int
    body: dict[str, Any]


class KubeApi:
    """The reconciler's view of the API: apply, delete, status patch, events, leases.

    `metrics` is the process's OperatorMetrics (the runner's); without one, the instance counts into a private
    registry of its own (tests, the benchmark's read-only client)."""

    def __init__(
        self,
        client: k8s.ApiClient,
        is_leader: Callable[[], bool] = lambda: True,
        *,
        metrics: OperatorMetrics | None = None,
    ) -> None:
        self._client = client
        self._is_leader = is_leader
        self.metrics = metrics if metrics is not None else OperatorMetrics()
        self.requests: collections.Counter[str] = collections.Counter()
        self.writes: collections.Counter[str] = collections.Counter()

    # ------------------------------------------------------------------------------------------------ plumbing

    def _request(
        self,
        method: str,
        path: str,
        kind: str,
        *,
        query: list[tuple[str, str]] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> Response:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        try:
            method_, url, headers_, body_, post = self._client.param_serialize(
                method, path, query_params=query or [], header_params=headers, body=body, auth_settings=["BearerToken"]
            )
            raw = self._client.call_api(method_, url, headers_, body_, post, _request_timeout=REQUEST_TIMEOUT)
            data = raw.read()  # type: ignore[no-untyped-call]
            code = raw.status
        except k8s.ApiException as exc:  # raised by the REST layer for transport-level failures
            code, data = exc.status or 0, (exc.body or str(exc)).encode() if isinstance(exc.body, str) else b""
        except Exception as exc:  # connection refused, timeouts: counted and surfaced as retriable
            self.metrics.api_requests.labels(method, kind, "error").inc()
            self.requests[f"{method} {kind}"] += 1
            raise ApiError(0, str(exc), "ConnectionError") from exc
        self.metrics.api_requests.labels(method, kind, str(code)).inc()
        self.requests[f"{method} {kind}"] += 1
        try:
            parsed = json.loads(data) if data else {}
        except ValueError:
            parsed = {"message": data.decode(errors="replace")}
        if not 200 <= code < 300:
            raise ApiError(code, str(parsed.get("message", parsed)), str(parsed.get("reason", "")))
        return Response(code, parsed)

    def _write(self, verb: str, kind: str) -> None:
        if not self._is_leader():
            raise NotLeaderError(f"not the leader; refusing to {verb} {kind}")
        self.metrics.writes.labels(verb, kind).inc()
        self.writes[f"{verb} {kind}"] += 1

    @property
    def total_requests(self) -> int:
        return sum(self.requests.values())

    @property
    def total_writes(self) -> int:
        return sum(self.writes.values())

    # -------------------------------------------------------------------------------------------------- writes

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply `obj` under our field manager, forcing conflicts (we are its controller)."""
        kind = kind_of(obj)
        meta = obj["metadata"]
        self._write("apply", kind.kind)
        response = self._request(
            "PATCH",
            kind.object_path(meta["namespace"], meta["name"]),
            kind.kind,
            query=[("fieldManager", FIELD_MANAGER), ("force", "true")],
            body=obj,
            content_type="application/apply-patch+yaml",
        )
        return response.body

    def delete(self, kind: Kind, namespace: str, name: str, uid: str) -> None:
        """Delete with a UID precondition (never a same-named successor); background propagation."""
        self._write("delete", kind.kind)
        body = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "preconditions": {"uid": uid},
            "propagationPolicy": "Background",
        }
        try:
            self._request("DELETE", kind.object_path(namespace, name), kind.kind, body=body)
        except ApiError as exc:
            if exc.not_found:
                return
            raise

    def patch_status(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """JSON-merge-patch the status subresource of a PDService."""
        self._write("status", PDSERVICE.kind)
        path = PDSERVICE.object_path(namespace, name) + "/status"
        return self._request(
            "PATCH", path, PDSERVICE.kind, body={"status": patch}, content_type="application/merge-patch+json"
        ).body

    def scale(self, kind: Kind, namespace: str, name: str, replicas: int) -> dict[str, Any]:
        """Set `replicas` through the object's scale subresource (autoscaling/v1 Scale), as the autoscaler's field
        manager. A merge patch of `spec.replicas` only: it changes nothing else of the object, needs no read first,
        and is exactly what `kubectl scale` and HPA send. Returns the Scale the API server answered with (its
        resourceVersion is the object's)."""
        self._write("scale", kind.kind)
        return self._request(
            "PATCH",
            kind.object_path(namespace, name) + "/scale",
            kind.kind,
            query=[("fieldManager", AUTOSCALER_FIELD_MANAGER)],
            body={"spec": {"replicas": replicas}},
            content_type="application/merge-patch+json",
        ).body

    def post_event(self, involved: dict[str, Any], type_: str, reason: str, message: str, now: str) -> None:
        """A core/v1 Event about `involved` (a PDService). Failures are logged, never raised: events are advisory."""
        meta = involved["metadata"]
        namespace = meta.get("namespace", "default")
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": namespace},
            "involvedObject": {
                "apiVersion": involved.get("apiVersion", PDSERVICE.api_version),
                "kind": involved.get("kind", PDSERVICE.kind),
                "name": meta["name"],
                "namespace": namespace,
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": FIELD_MANAGER},
            "reportingComponent": FIELD_MANAGER,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self._write("event", EVENT.kind)
            self._request("POST", EVENT.collection_path(namespace), EVENT.kind, body=event)
        except (ApiError, NotLeaderError) as exc:
            log.warning("Failed to post event reason=%s pdservice=%s/%s error=%s", reason, namespace, meta["name"], exc)

    # --------------------------------------------------------------------------------------------------- reads

    def read(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        """One object by name, None when there is none: what a child's name holds before the operator creates it
        (the informer cache only holds objects with pdserve's labels; `reconcile.look_up`), or an object of a kind
        the informers do not watch (the InferencePool)."""
        try:
            body = self._request("GET", kind.object_path(namespace, name), kind.kind).body
        except ApiError as exc:
            if exc.not_found:
                return None
            raise
        body.setdefault("apiVersion", kind.api_version)
        body.setdefault("kind", kind.kind)
        return body

    def node(self, name: str) -> dict[str, Any]:
        """One Node (its labels name the topology domain of the engines on it; `nodes.NodeLabelCache`)."""
        return self._request("GET", f"{NODE.collection_path(None)}/{name}", NODE.kind).body

    # ------------------------------------------------------------------------- raw (leader election, not counted
    # as reconcile writes: the lease is renewed every retry period whatever the reconciler does)

    def get(self, path: str, kind: str) -> dict[str, Any]:
        return self._request("GET", path, kind).body

    def create_raw(self, path: str, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        self.metrics.lease_writes.inc()
        return self._request("POST", path, kind, body=body).body

    def replace_raw(self, path: str, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        self.metrics.lease_writes.inc()
        return self._request("PUT", path, kind, body=body).body

    def list_at(self, path: str, kind: str, label_selector: str = "") -> tuple[list[dict[str, Any]], str]:
        """The items and the list's own resourceVersion (the revision the snapshot was taken at: an object whose
        resourceVersion is higher was written after it, so a relist must not drop it for being absent)."""
        query = [("labelSelector", label_selector)] if label_selector else []
        body = self._request("GET", path, kind, query=query).body
        return list(body.get("items", [])), str((body.get("metadata") or {}).get("resourceVersion") or "")

    def list(self, path: str, kind: str, label_selector: str = "") -> list[dict[str, Any]]:
        return self.list_at(path, kind, label_selector)[0]
