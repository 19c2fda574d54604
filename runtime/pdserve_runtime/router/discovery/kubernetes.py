"""Kubernetes discovery: the pools' EndpointSlices, and the operator's discovery ConfigMap when configured.

The router reads no Pods (their specs carry env values, and the router faces clients): what it pairs and scores on
reaches it on the objects it watches (`pdserve.api.router_config` describes the contract, the operator's
`render.discovery` produces it):
- an engine's kv-compat value is its slice's `kvCompatLabel` label. The operator keeps one Service per pool and
  kv-compat value; the EndpointSlice controller copies the Service's labels onto its slices and lists in them only
  the pods carrying that value, so the label is true of every endpoint of the slice from the moment it appears.
  A URL listed under two different values at once (a pod label edited by hand, briefly in two Services' slices) is
  left out: pairing it with either would be a guess.
- its topology: the endpoint's `zone` and `nodeName`, plus the labels of its node from the discovery ConfigMap
  (`discoveryConfigMap`, key `nodes.json`), for the labels in `topologyLabels`. Until that ConfigMap is read (or for
  a node it does not list), an engine simply has no domain for those labels: topology weighs a score, never a
  pairing.
- that it is the PDService's at all: only slices the EndpointSlice controller made for a Service the operator owns
  (the same ConfigMap, key `services.json`), and only pods named as members of the pool's StatefulSet
  (`trust.py`); until that ConfigMap is read, no engine.

Watching: one thread per watched collection (each pool's slices by its label selector; the ConfigMap by name, as
its Role allows: a list or watch selecting `metadata.name`) runs the usual list-then-watch loop of the
`kubernetes` client with raw JSON objects, and hands every change to the event loop with `call_soon_threadsafe`;
the loop thread alone touches the table. Any error (API down, 410 Gone, network) restarts the loop with
exponential backoff (0.5 s doubling to 30 s) after a fresh list, and meanwhile the router keeps serving from the
last table: engines that still answer keep working, the circuit breaker handles those that do not. No request
ever waits on the API: the API load grows with pod changes, not with traffic.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import pydantic

from pdserve.api.router_config import (
    HOSTNAME_LABEL,
    NODE_TOPOLOGY_KEY,
    OWNED_SERVICES_KEY,
    ZONE_LABEL,
    EndpointSelector,
    KvEventsPortNames,
    NodeTopology,
    OwnedServices,
    RouterConfig,
)
from pdserve_runtime.router.discovery.trust import trusted_slices
from pdserve_runtime.router.endpoints import Endpoint, EndpointTable, KvEventSource, Role

log = logging.getLogger("pdserve.router.discovery")

NodeLabels = Mapping[str, Mapping[str, str]]  # node name -> topology label -> value


def endpoints_from_slice(
    slice_obj: Mapping[str, Any],
    *,
    role: Role,
    port_name: str,
    kv_compat_label: str,
    topology_labels: Sequence[str],
    nodes: NodeLabels,
    kv_events_ports: Sequence[KvEventsPortNames] = (),
) -> list[Endpoint]:
    """The engines one EndpointSlice describes (pure).

    Skips FQDN slices and slices without the named port. The kv-compat value is the slice's label (None without
    one).

    `ready` (may take new requests) needs all three EndpointSlice conditions to allow it, an absent one meaning
    yes as the API says: `ready` (false for a terminating pod unless its Service publishes not-ready addresses),
    `serving` (the pod's readiness, kept up to date while it terminates: a draining engine's /health turns it
    false) and not `terminating`. A terminating engine stays in the table, not ready, until its endpoint is gone,
    so the requests it already has finish there (its drain) while new ones go elsewhere.
    """
    if slice_obj.get("addressType") not in ("IPv4", "IPv6"):
        return []
    port = next(
        (p.get("port") for p in slice_obj.get("ports") or () if p.get("name") == port_name and p.get("port")), None
    )
    if port is None:
        return []
    ports = {p.get("name"): p.get("port") for p in slice_obj.get("ports") or () if p.get("port")}
    kv_compat = ((slice_obj.get("metadata") or {}).get("labels") or {}).get(kv_compat_label) or None
    found: list[Endpoint] = []
    for entry in slice_obj.get("endpoints") or ():
        ref = entry.get("targetRef") or {}
        pod_name = ref.get("name") if ref.get("kind") == "Pod" else None
        topology: dict[str, str] = {}
        if entry.get("zone"):
            topology[ZONE_LABEL] = entry["zone"]
        node = entry.get("nodeName")
        if node:
            topology[HOSTNAME_LABEL] = node
            node_labels = nodes.get(node) or {}
            for label in topology_labels:
                if label not in topology and node_labels.get(label):
                    topology[label] = node_labels[label]
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
                    kv_compat=kv_compat,
                    topology=topology,
                    ready=ready,
                    name=pod_name or address,
                    kv_events=kv_event_sources(host, ports, kv_events_ports),
                )
            )
    return found


def kv_event_sources(
    host: str, ports: Mapping[Any, Any], names: Sequence[KvEventsPortNames]
) -> tuple[KvEventSource, ...]:
    """An engine's KV event publishers from its slice's named ports (pure): one per data-parallel rank whose
    publisher port the slice lists; its replay port when listed too."""
    sources: list[KvEventSource] = []
    for entry in names:
        events = ports.get(entry.events)
        if not isinstance(events, int):
            continue
        replay = ports.get(entry.replay) if entry.replay else None
        sources.append(
            KvEventSource(f"tcp://{host}:{events}", f"tcp://{host}:{replay}" if isinstance(replay, int) else None)
        )
    return tuple(sources)


def pool_endpoints(
    slices: Iterable[Mapping[str, Any]],
    *,
    role: Role,
    port_name: str,
    kv_compat_label: str,
    topology_labels: Sequence[str],
    nodes: NodeLabels,
    kv_events_ports: Sequence[KvEventsPortNames] = (),
) -> list[Endpoint]:
    """All engines of a pool, one per URL: a ready copy wins over a not-ready one (a pod in two slices of one
    Service while the controller moves it); a URL listed under two kv-compat values is left out."""
    by_url: dict[str, Endpoint] = {}
    conflicting: set[str] = set()
    for slice_obj in slices:
        for endpoint in endpoints_from_slice(
            slice_obj,
            role=role,
            port_name=port_name,
            kv_compat_label=kv_compat_label,
            topology_labels=topology_labels,
            nodes=nodes,
            kv_events_ports=kv_events_ports,
        ):
            current = by_url.get(endpoint.url)
            if current is not None and current.kv_compat != endpoint.kv_compat:
                conflicting.add(endpoint.url)
            if current is None or (endpoint.ready and not current.ready):
                by_url[endpoint.url] = endpoint
    return sorted((e for url, e in by_url.items() if url not in conflicting), key=lambda endpoint: endpoint.url)


def parse_node_topology(config_map: Mapping[str, Any]) -> NodeLabels:
    """The node labels a discovery ConfigMap publishes; ValueError when it does not hold a NodeTopology."""
    text = (config_map.get("data") or {}).get(NODE_TOPOLOGY_KEY)
    if text is None:
        raise ValueError(f"no key {NODE_TOPOLOGY_KEY}")
    try:
        return NodeTopology.model_validate_json(text).nodes
    except pydantic.ValidationError as exc:
        raise ValueError(f"{NODE_TOPOLOGY_KEY} is not a node topology: {exc.error_count()} errors") from None


def parse_owned_services(config_map: Mapping[str, Any]) -> Mapping[str, str]:
    """The Services (name -> UID) a discovery ConfigMap lists as the operator's; ValueError when it does not hold
    an OwnedServices."""
    text = (config_map.get("data") or {}).get(OWNED_SERVICES_KEY)
    if text is None:
        raise ValueError(f"no key {OWNED_SERVICES_KEY}")
    try:
        return OwnedServices.model_validate_json(text).services
    except pydantic.ValidationError as exc:
        raise ValueError(f"{OWNED_SERVICES_KEY} is not a list of owned Services: {exc.error_count()} errors") from None


class _Collection:
    """The last known objects of one watched collection, by name (event loop thread only)."""

    def __init__(self) -> None:
        self.objects: dict[str, Mapping[str, Any]] = {}
        self.synced = False
        self.changed = False

    def replace(self, items: Iterable[Mapping[str, Any]]) -> None:
        self.objects = {item["metadata"]["name"]: item for item in items}
        self.synced = True
        self.changed = True

    def apply(self, event_type: str, obj: Mapping[str, Any]) -> None:
        name = obj["metadata"]["name"]
        if event_type == "DELETED":
            self.objects.pop(name, None)
        else:
            self.objects[name] = obj
        self.changed = True


class KubernetesDiscovery:
    """Keeps the endpoint table in step with the pools' EndpointSlices (and the operator's discovery ConfigMap)."""

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
        self._topology = _Collection()
        self._nodes: NodeLabels = {}
        # The Services whose slices may hold engines (name -> UID); None until the discovery ConfigMap is read.
        self._owned: Mapping[str, str] | None = None
        self._ignored: dict[Role, set[str]] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        api = self._api_client_factory()
        from kubernetes import client

        discovery_api = client.DiscoveryV1Api(api)
        for role, selector in self._selectors.items():
            self._spawn(
                f"slices-{role}",
                discovery_api.list_namespaced_endpoint_slice,
                selector.namespace,
                {"label_selector": selector.label_selector},
                self._slices[role],
            )
        source = self._config.discovery_config_map
        if source is not None:
            self._spawn(
                "node-topology",
                client.CoreV1Api(api).list_namespaced_config_map,
                source.namespace,
                {"field_selector": f"metadata.name={source.name}"},
                self._topology,
            )

    async def stop(self) -> None:
        self._stop.set()

    def _spawn(
        self, name: str, list_fn: Callable[..., Any], namespace: str, query: dict[str, str], into: _Collection
    ) -> None:
        thread = threading.Thread(
            target=self._watch_forever,
            args=(list_fn, namespace, query, into),
            name=f"pdserve-watch-{name}",
            daemon=True,  # a blocked watch read must not keep the process alive at exit
        )
        self._threads.append(thread)
        thread.start()

    def _watch_forever(
        self, list_fn: Callable[..., Any], namespace: str, query: dict[str, str], into: _Collection
    ) -> None:
        """List, then watch from the list's resourceVersion; on any error back off and start over."""
        from kubernetes import watch

        backoff = 0.5
        while not self._stop.is_set():
            try:
                listed = list_fn(namespace, _preload_content=False, _request_timeout=30, **query)
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
                    **query,
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
                    "Failed watching namespace=%s query=%s error=%s retry_in=%.1fs", namespace, query, exc, backoff
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

    def _refresh_nodes(self) -> None:
        """Parse the discovery ConfigMap when it changed; a malformed document keeps the last good one."""
        if not self._topology.changed:
            return
        self._topology.changed = False
        found = list(self._topology.objects.values())
        before, owned_before = self._nodes, self._owned
        if not found:
            self._nodes = {}  # deleted (or never there): no node labels, the slices' zone and node still count
            self._owned = {} if self._topology.synced else None  # and no Service is proven the operator's
        else:
            try:
                self._nodes = parse_node_topology(found[0])
            except ValueError as exc:
                log.warning("Ignored node topology configmap=%s error=%s", found[0]["metadata"]["name"], exc)
            try:
                self._owned = parse_owned_services(found[0])
            except ValueError as exc:  # keeps the last good list (none before the first: no engine)
                log.warning("Ignored owned services configmap=%s error=%s", found[0]["metadata"]["name"], exc)
        if self._nodes != before:
            log.info("Updated node topology nodes=%d", len(self._nodes))
        if self._owned != owned_before:
            log.info("Updated owned services services=%s", sorted(self._owned or {}))

    def _rebuild(self) -> None:
        config = self._config
        self._refresh_nodes()
        for role, selector in self._selectors.items():
            slices = self._slices[role]
            if not slices.synced:
                continue  # never replace a pool with "nothing" before the first list came back
            trusted = trusted_slices(
                slices.objects.values(),
                owned=self._owned,
                require_owned=config.discovery_config_map is not None,
                statefulset=selector.statefulset,
            )
            self._log_ignored(role, trusted.ignored)
            endpoints = pool_endpoints(
                trusted.slices,
                role=role,
                port_name=selector.port_name,
                kv_compat_label=config.kv_compat_label,
                topology_labels=config.topology_labels,
                nodes=self._nodes,
                kv_events_ports=selector.kv_events_ports if config.policy.kv_events else (),
            )
            before = {state.url for state in self._table.states(role)}
            self._table.replace(role, endpoints)
            after = {endpoint.url for endpoint in endpoints}
            if before != after:
                log.info("Updated %s endpoints count=%d added=%s removed=%s", role, len(after),
                         sorted(after - before), sorted(before - after))  # fmt: skip

    def _log_ignored(self, role: Role, ignored: list[str]) -> None:
        """Say once (while it lasts) what the pool's selector found but the router does not trust (`trust.py`):
        someone's Service or pod carrying the pool's labels."""
        before = self._ignored.get(role, set())
        for reason in ignored:
            if reason not in before:
                log.warning("Ignored untrusted %s engines %s", role, reason)
        self._ignored[role] = set(ignored)


def _default_api_client() -> Any:
    """An API client by pdserve's one order (pdserve.api.kubeclient): the router has no kubeconfig flag, so
    $KUBECONFIG (local runs, the process node's pods), else the pod's service account, else ~/.kube/config."""
    from pdserve.api.kubeclient import new_api_client  # lazy: static discovery never loads the kubernetes client

    return new_api_client()
