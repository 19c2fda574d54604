"""Kubernetes discovery: EndpointSlices of the prefill and decode Services, joined with their Pods' labels.

Why both: an EndpointSlice says which addresses are ready and where they are (zone, node), but not the pod
labels the router pairs on (`pdserve.io/kv-compat`, topology labels set on pods). Endpoints point at their pod
through `targetRef`, so the table is `endpoints_from_slice(slice, pod labels)` over all slices of a pool.

Watching: one thread per watched collection (each slice selector; the pods of each namespace, only those matching
the pool's `podLabelSelector` when it is set) runs the usual
list-then-watch loop of the `kubernetes` client with raw JSON objects, and hands every change to the event loop
with `call_soon_threadsafe`; the loop thread alone touches the table. Any error (API down, 410 Gone, network)
restarts the loop with exponential backoff (0.5 s doubling to 30 s) after a fresh list, and meanwhile the router
keeps serving from the last table: engines that still answer keep working, the circuit breaker handles those
that do not. An endpoint whose pod is not known yet is left out until the pod watch catches up, because
without its kv-compat label it could be paired with an incompatible engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from pdserve.api.router_config import EndpointSelector, RouterConfig
from pdserve_runtime.router.endpoints import Endpoint, EndpointTable, Role

log = logging.getLogger("pdserve.router.discovery")

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
ZONE_LABEL = "topology.kubernetes.io/zone"
HOSTNAME_LABEL = "kubernetes.io/hostname"

PodLabels = Mapping[str, Mapping[str, str]]


def endpoints_from_slice(
    slice_obj: Mapping[str, Any],
    *,
    role: Role,
    port_name: str,
    pods: PodLabels,
    kv_compat_label: str,
    topology_labels: Sequence[str],
) -> list[Endpoint]:
    """The engines one EndpointSlice describes (pure).

    Skips FQDN slices, slices without the named port, and endpoints whose target pod is unknown.

    `ready` (may take new requests) needs all three EndpointSlice conditions to allow it, an absent one meaning
    yes as the API says: `ready` (false for a terminating pod unless its Service publishes not-ready addresses),
    `serving` (the pod's readiness, kept up to date while it terminates: a draining engine's /health turns it
    false) and not `terminating`. A terminating engine stays in the table, not ready, until its pod is gone, so
    the requests it already has finish there (its drain) while new ones go elsewhere.
    """
    if slice_obj.get("addressType") not in ("IPv4", "IPv6"):
        return []
    port = next(
        (p.get("port") for p in slice_obj.get("ports") or () if p.get("name") == port_name and p.get("port")), None
    )
    if port is None:
        return []
    found: list[Endpoint] = []
    for entry in slice_obj.get("endpoints") or ():
        ref = entry.get("targetRef") or {}
        pod_name = ref.get("name") if ref.get("kind") == "Pod" else None
        labels: Mapping[str, str] = {}
        if pod_name is not None:
            known = pods.get(pod_name)
            if known is None:
                continue  # wait for the pod watch: its kv-compat label decides pairing
            labels = known
        topology: dict[str, str] = {}
        if entry.get("zone"):
            topology[ZONE_LABEL] = entry["zone"]
        if entry.get("nodeName"):
            topology[HOSTNAME_LABEL] = entry["nodeName"]
        for label in topology_labels:
            if labels.get(label):
                topology[label] = labels[label]
        conditions = entry.get("conditions") or {}
        ready = (
            conditions.get("ready") is not False
            and conditions.get("serving") is not False
            and conditions.get("terminating") is not True
        )
        for address in entry.get("addresses") or ():
            host = f"[{address}]" if ":" in address else address
            found.append(
                Endpoint(
                    url=f"http://{host}:{port}",
                    role=role,
                    kv_compat=labels.get(kv_compat_label),
                    topology=topology,
                    ready=ready,
                    name=pod_name or address,
                )
            )
    return found


def pool_endpoints(
    slices: Iterable[Mapping[str, Any]],
    *,
    role: Role,
    port_name: str,
    pods: PodLabels,
    kv_compat_label: str,
    topology_labels: Sequence[str],
) -> list[Endpoint]:
    """All engines of a pool, one per URL; a ready copy wins over a not-ready one (a pod in two slices)."""
    by_url: dict[str, Endpoint] = {}
    for slice_obj in slices:
        for endpoint in endpoints_from_slice(
            slice_obj,
            role=role,
            port_name=port_name,
            pods=pods,
            kv_compat_label=kv_compat_label,
            topology_labels=topology_labels,
        ):
            current = by_url.get(endpoint.url)
            if current is None or (endpoint.ready and not current.ready):
                by_url[endpoint.url] = endpoint
    return sorted(by_url.values(), key=lambda endpoint: endpoint.url)


class _Collection:
    """The last known objects of one watched collection, by name (event loop thread only)."""

    def __init__(self) -> None:
        self.objects: dict[str, Mapping[str, Any]] = {}
        self.synced = False

    def replace(self, items: Iterable[Mapping[str, Any]]) -> None:
        self.objects = {item["metadata"]["name"]: item for item in items}
        self.synced = True

    def apply(self, event_type: str, obj: Mapping[str, Any]) -> None:
        name = obj["metadata"]["name"]
        if event_type == "DELETED":
            self.objects.pop(name, None)
        else:
            self.objects[name] = obj


class KubernetesDiscovery:
    """Keeps the endpoint table in step with the prefill and decode Services' EndpointSlices."""

    def __init__(
        self,
        config: RouterConfig,
        table: EndpointTable,
        api_client_factory: Callable[[], Any] | None = None,
    ) -> None:
        self._config = config
        self._table = table
        self._api_client_factory = api_client_factory or _default_api_client
        self._selectors: dict[Role, EndpointSelector] = {}
        if config.prefill is not None:
            self._selectors["prefill"] = config.prefill
        if config.decode is not None:
            self._selectors["decode"] = config.decode
        self._slices: dict[Role, _Collection] = {role: _Collection() for role in self._selectors}
        # One Pod watch per (namespace, pod label selector): pools that share both share the watch.
        self._pods: dict[tuple[str, str | None], _Collection] = {
            (sel.namespace, sel.pod_label_selector): _Collection() for sel in self._selectors.values()
        }
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        api = self._api_client_factory()
        from kubernetes import client

        discovery_api = client.DiscoveryV1Api(api)
        core_api = client.CoreV1Api(api)
        for role, selector in self._selectors.items():
            self._spawn(
                f"slices-{role}",
                discovery_api.list_namespaced_endpoint_slice,
                selector.namespace,
                f"{SERVICE_NAME_LABEL}={selector.service_name}",
                self._slices[role],
            )
        for (namespace, pod_selector), pods in self._pods.items():
            self._spawn(f"pods-{namespace}", core_api.list_namespaced_pod, namespace, pod_selector, pods)

    async def stop(self) -> None:
        self._stop.set()

    def _spawn(
        self, name: str, list_fn: Callable[..., Any], namespace: str, selector: str | None, into: _Collection
    ) -> None:
        thread = threading.Thread(
            target=self._watch_forever,
            args=(list_fn, namespace, selector, into),
            name=f"pdserve-watch-{name}",
            daemon=True,  # a blocked watch read must not keep the process alive at exit
        )
        self._threads.append(thread)
        thread.start()

    def _watch_forever(
        self, list_fn: Callable[..., Any], namespace: str, selector: str | None, into: _Collection
    ) -> None:
        """List, then watch from the list's resourceVersion; on any error back off and start over."""
        from kubernetes import watch

        backoff = 0.5
        kwargs: dict[str, Any] = {"label_selector": selector} if selector else {}
        while not self._stop.is_set():
            try:
                listed = list_fn(namespace, _preload_content=False, _request_timeout=30, **kwargs)
                data = json.loads(listed.data)
                version = data["metadata"]["resourceVersion"]
                self._post(into.replace, data.get("items") or [])
                backoff = 0.5
                watcher = watch.Watch()  # type: ignore[no-untyped-call]
                for event in watcher.stream(  # type: ignore[no-untyped-call]
                    list_fn,
                    namespace,
                    resource_version=version,
                    timeout_seconds=60,
                    allow_watch_bookmarks=True,
                    _request_timeout=90,
                    **kwargs,
                ):
                    if self._stop.is_set():
                        watcher.stop()  # type: ignore[no-untyped-call]
                        return
                    event_type = event.get("type")
                    raw = event.get("raw_object")
                    if event_type in ("ADDED", "MODIFIED", "DELETED") and isinstance(raw, dict):
                        self._post(into.apply, event_type, raw)
                    elif event_type == "ERROR":
                        raise RuntimeError(f"watch error event: {raw}")
                # A watch that ends normally (server timeout) is simply restarted after a fresh list.
            except Exception as exc:  # the API server may fail in any way; never kill the thread
                if self._stop.is_set():
                    return
                log.warning(
                    "Failed watching namespace=%s selector=%s error=%s retry_in=%.1fs",
                    namespace,
                    selector,
                    exc,
                    backoff,
                )
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` and rebuild the table on the event loop thread."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        def apply() -> None:
            fn(*args)
            self._rebuild()

        with contextlib.suppress(RuntimeError):  # the loop is shutting down
            loop.call_soon_threadsafe(apply)

    def _rebuild(self) -> None:
        config = self._config
        for role, selector in self._selectors.items():
            slices = self._slices[role]
            pods = self._pods[(selector.namespace, selector.pod_label_selector)]
            if not slices.synced:
                continue  # never replace a pool with "nothing" before the first list came back
            labels = {name: (pod.get("metadata") or {}).get("labels") or {} for name, pod in pods.objects.items()}
            endpoints = pool_endpoints(
                slices.objects.values(),
                role=role,
                port_name=selector.port_name,
                pods=labels,
                kv_compat_label=config.kv_compat_label,
                topology_labels=config.topology_labels,
            )
            before = {state.url for state in self._table.states(role)}
            self._table.replace(role, endpoints)
            after = {endpoint.url for endpoint in endpoints}
            if before != after:
                log.info("Updated %s endpoints count=%d added=%s removed=%s", role, len(after),
                         sorted(after - before), sorted(before - after))  # fmt: skip


def _default_api_client() -> Any:
    """An API client by pdserve's one order (pdserve.api.kubeclient): the router has no kubeconfig flag, so
    $KUBECONFIG (local runs, the process node's pods), else the pod's service account, else ~/.kube/config."""
    from pdserve.api.kubeclient import new_api_client  # lazy: static discovery never loads the kubernetes client

    return new_api_client()
