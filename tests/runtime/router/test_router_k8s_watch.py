"""Kubernetes discovery against a small fake API server on loopback: list, watch, rollouts, topology, outages.

The fake implements just the list and watch calls the `kubernetes` client makes for EndpointSlices and ConfigMaps
(JSON lists with a resourceVersion, newline-delimited watch events that resume from the resourceVersion a
watch asks for, label and `metadata.name` field selectors), so the real client code, the watch threads and the
hand-over to the event loop are all exercised without a cluster. It answers 403 to anything else (a Pod list, a
ConfigMap list that does not select the one name), as the router's Role would.

Nothing here sleeps and then asserts that something did not happen: the test waits for a counted event (the
endpoint table's version moving on, the fake counting the calls it refused) and then asserts.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from pdserve.api.router_config import CircuitBreakerConfig, DiscoveryConfigMap, EndpointSelector, RouterConfig
from pdserve_dev.testing.metrics import metric_value, scrape
from pdserve_dev.testing.sim import requests_seen, set_faults, sim_in_process
from pdserve_dev.testing.wait import wait_for_async
from pdserve_runtime.router.discovery.kubernetes import KubernetesDiscovery
from pdserve_runtime.router.endpoints import EndpointTable

pytestmark = pytest.mark.timeout(60)

NS = "llm"
KV = "pdserve.io/kv-compat"

Event = tuple[int, str, str, dict[str, Any]]  # resourceVersion, collection, event type, object


class FakeApi:
    """Objects by collection, a global resourceVersion, the event history, and open watch streams.

    `down` makes it answer every call with 503 and drop its watches (an API server outage); `refused`
    counts the calls it refused per (collection, label selector), i.e. per discovery watch loop.
    """

    def __init__(self) -> None:
        self.version = 1
        self.objects: dict[str, dict[str, dict[str, Any]]] = {"endpointslices": {}, "configmaps": {}}
        self.history: list[Event] = []
        self.watchers: list[tuple[str, str | None, str | None, asyncio.Queue[dict[str, Any] | None]]] = []
        self.lists = 0
        self.down = False
        self.refused: dict[tuple[str, str | None], int] = {}
        self.forbidden: list[str] = []
        # The one ConfigMap the router's Role names (resourceNames): only a list/watch selecting it is allowed.
        self.readable_config_map = DISCOVERY

    def put(self, collection: str, obj: dict[str, Any], event: str = "MODIFIED") -> None:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        name = obj["metadata"]["name"]
        kind = "ADDED" if name not in self.objects[collection] else event
        self.objects[collection][name] = obj
        self._notify(collection, kind, obj)

    def delete(self, collection: str, name: str) -> None:
        self.version += 1
        obj = self.objects[collection].pop(name)
        self._notify(collection, "DELETED", obj)

    def _notify(self, collection: str, kind: str, obj: dict[str, Any]) -> None:
        self.history.append((self.version, collection, kind, obj))
        for watched, selector, fields, queue in self.watchers:
            if watched == collection and _matches(obj, selector, fields):
                queue.put_nowait({"type": kind, "object": obj})

    def close_watches(self) -> None:
        for *_, queue in self.watchers:
            queue.put_nowait(None)

    def outage(self) -> None:
        """From now on every call fails with 503, and open watches end."""
        self.down = True
        self.close_watches()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        collection = request.match_info["collection"]
        selector = request.query.get("labelSelector")
        fields = request.query.get("fieldSelector")
        if collection not in self.objects or (
            collection == "configmaps" and fields != f"metadata.name={self.readable_config_map}"
        ):
            self.forbidden.append(request.path_qs)
            return web.json_response({"kind": "Status", "status": "Failure", "code": 403}, status=403)
        if self.down:
            key = (collection, selector or fields)
            self.refused[key] = self.refused.get(key, 0) + 1
            return web.json_response({"kind": "Status", "status": "Failure", "code": 503}, status=503)
        if request.query.get("watch") in ("true", "1", "True"):
            # Replay what happened after the version the watch starts from, then follow live events; both are
            # set up before the first await, so no event can fall between them.
            since = int(request.query.get("resourceVersion") or self.version)
            queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
            for version, watched, kind, obj in self.history:
                if version > since and watched == collection and _matches(obj, selector, fields):
                    queue.put_nowait({"type": kind, "object": obj})
            entry = (collection, selector, fields, queue)
            self.watchers.append(entry)
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            try:
                await response.prepare(request)
                while (event := await queue.get()) is not None:
                    await response.write(json.dumps(event).encode() + b"\n")
            finally:
                self.watchers.remove(entry)
            return response
        self.lists += 1
        items = [obj for obj in self.objects[collection].values() if _matches(obj, selector, fields)]
        return web.json_response({"metadata": {"resourceVersion": str(self.version)}, "items": items})


_REQUIREMENT = re.compile(r"^\s*(!?)([\w./-]+)\s*(?:(==|=|!=)\s*([\w./-]*)|\s+(in|notin)\s*\(([^)]*)\))?\s*$")


def _matches(obj: dict[str, Any], selector: str | None, fields: str | None = None) -> bool:
    """Kubernetes label-selector matching for what a router might send: `k=v`, `k==v`, `k!=v`, `k`, `!k`,
    `k in (a,b)`, `k notin (a,b)`, comma-separated; the field selector `metadata.name=<name>`."""
    if fields is not None:
        assert fields.startswith("metadata.name="), f"the fake API cannot parse field selector {fields!r}"
        if obj["metadata"]["name"] != fields.removeprefix("metadata.name="):
            return False
    if not selector:
        return True
    labels = obj["metadata"].get("labels", {})
    for requirement in re.split(r",(?![^(]*\))", selector):
        match = _REQUIREMENT.match(requirement)
        assert match is not None, f"the fake API cannot parse label selector {selector!r}"
        negate, key, op, value, set_op, values = match.groups()
        if op in ("=", "=="):
            ok = labels.get(key) == value
        elif op == "!=":
            ok = labels.get(key) != value
        elif set_op is not None:
            ok = (labels.get(key) in {v.strip() for v in values.split(",")}) == (set_op == "in")
        else:
            ok = (key in labels) != bool(negate)
        if not ok:
            return False
    return True


INSTANCE = "app.kubernetes.io/instance"
ROLE = "pdserve.io/role"
RACK = "example.com/rack"
DISCOVERY = "svc-router-discovery"
# The per-kv-compat Services the operator owns in these tests, as its discovery ConfigMap lists them.
OWNED = {f"svc-{role}-{kv}": f"uid-svc-{role}-{kv}" for role in ("prefill", "decode") for kv in ("v1", "v2")}


def selector(role: str) -> str:
    """What the renderer writes: the instance's pool slices that carry a kv-compat value."""
    return f"{INSTANCE}=svc,{ROLE}={role},{KV}"


def endpoint_slice(
    name: str, role: str, kv: str | None, *endpoints: tuple[str, str, bool], port: int = 8000
) -> dict[str, Any]:
    """A slice of the pool's Service for kv-compat value `kv` (None: the pool's own headless Service), as the
    EndpointSlice controller makes it: its managed-by label and a controller reference to the Service's UID."""
    service = f"svc-{role}" + (f"-{kv}" if kv else "")
    labels = {
        "kubernetes.io/service-name": service,
        "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
        INSTANCE: "svc",
        ROLE: role,
    }
    if kv is not None:
        labels[KV] = kv
    owner = {"apiVersion": "v1", "kind": "Service", "name": service, "uid": f"uid-{service}", "controller": True}
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": NS, "labels": labels, "ownerReferences": [owner]},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": [
            {
                "addresses": [ip],
                "conditions": {"ready": ready},
                "nodeName": f"node-{pod_name}",
                "targetRef": {"kind": "Pod", "name": pod_name},
            }
            for ip, pod_name, ready in endpoints
        ],
    }


def topology_map(
    nodes: dict[str, dict[str, str]] | str, name: str = DISCOVERY, services: dict[str, str] | None = None
) -> dict[str, Any]:
    """The operator's discovery ConfigMap: node labels (or a malformed text), and the Services it owns."""
    text = nodes if isinstance(nodes, str) else json.dumps({"nodes": nodes})
    owned = json.dumps({"services": OWNED if services is None else services})
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": NS},
        "data": {"nodes.json": text, "services.json": owned},
    }


@pytest.fixture
async def fake_api() -> AsyncIterator[tuple[FakeApi, int]]:
    api = FakeApi()
    api.put("configmaps", topology_map({}))  # the operator's discovery ConfigMap: no node labels yet
    app = web.Application()
    app.router.add_get("/api/v1/namespaces/{ns}/{collection}", api.handle)
    app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/{ns}/{collection}", api.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        _host, port = runner.addresses[0][:2]
        yield api, int(port)
    finally:
        api.close_watches()
        await runner.cleanup()


def urls(table: EndpointTable, role: str, usable: bool = False) -> list[str]:
    states = table.usable(role) if usable else table.states(role)  # type: ignore[arg-type]
    return sorted(state.url for state in states)


async def until(check: Callable[[], bool], what: str, within: float = 10.0) -> None:
    """Wait (on the event loop, where discovery applies changes) until `check()` holds."""

    async def holds() -> bool:
        return check()

    await wait_for_async(holds, within=within, message=what)


async def rebuilt(table: EndpointTable, since: int) -> None:
    """Wait until discovery has rebuilt the table after version `since`: the change just made has been applied."""
    await until(lambda: table.version > since, f"the endpoint table to move on from version {since}")


def every_watch_refused_twice(api: FakeApi) -> bool:
    """Each discovery watch loop (the two slice selectors and the ConfigMap) has been refused, backed off and
    retried."""
    return len([key for key, n in api.refused.items() if n >= 2]) == 3


def api_client_for(port: int) -> Callable[[], Any]:
    from kubernetes import client

    return lambda: client.ApiClient(client.Configuration(host=f"http://127.0.0.1:{port}"))


def config(**extra: Any) -> RouterConfig:
    extra.setdefault("served_model_name", "m")
    return RouterConfig(
        prefill=EndpointSelector(namespace=NS, label_selector=selector("prefill")),
        decode=EndpointSelector(namespace=NS, label_selector=selector("decode")),
        topology_labels=[RACK],
        discovery_config_map=DiscoveryConfigMap(namespace=NS, name=DISCOVERY),
        **extra,
    )


def kv_of(table: EndpointTable, role: str) -> dict[str, str | None]:
    return {state.url: state.endpoint.kv_compat for state in table.states(role)}  # type: ignore[arg-type]


async def test_discovery_follows_slices_through_a_rollout_and_survives_an_api_outage(
    fake_api: tuple[FakeApi, int],
) -> None:
    api, port = fake_api
    api.put("endpointslices", endpoint_slice("pre-a", "prefill", "v1", ("10.1.0.1", "p-0", True)))
    api.put("endpointslices", endpoint_slice("dec-a", "decode", "v1", ("10.2.0.1", "d-0", True)))
    # The pools' own headless Services list the same pods without a value: never in the table.
    api.put("endpointslices", endpoint_slice("pre-plain", "prefill", None, ("10.1.0.1", "p-0", True)))
    api.put("endpointslices", endpoint_slice("dec-plain", "decode", None, ("10.2.0.9", "d-9", True)))
    table = EndpointTable()
    discovery = KubernetesDiscovery(config(), table, api_client_factory=api_client_for(port))
    await discovery.start()
    try:
        await until(
            lambda: (
                urls(table, "prefill") == ["http://10.1.0.1:8000"] and urls(table, "decode") == ["http://10.2.0.1:8000"]
            ),
            "the first lists in the table",
        )
        assert kv_of(table, "prefill") == {"http://10.1.0.1:8000": "v1"}

        # A rollout: the new value's Service lists the new pod; each engine carries the value of its slice.
        api.put("endpointslices", endpoint_slice("dec-b", "decode", "v2", ("10.2.0.2", "d-1", True)))
        await until(lambda: len(table.states("decode")) == 2, "the new decode engine in the table")
        assert kv_of(table, "decode") == {"http://10.2.0.1:8000": "v1", "http://10.2.0.2:8000": "v2"}

        # Readiness flips and deletions (the old value's Service pruned, its slice with it).
        api.put("endpointslices", endpoint_slice("dec-a", "decode", "v1", ("10.2.0.1", "d-0", False)))
        await until(lambda: urls(table, "decode", usable=True) == ["http://10.2.0.2:8000"], "d-0 not ready")
        api.delete("endpointslices", "dec-a")
        await until(lambda: urls(table, "decode") == ["http://10.2.0.2:8000"], "the old slice deleted")
        api.delete("endpointslices", "pre-a")
        await until(lambda: table.states("prefill") == (), "the prefill slice deleted")

        # The API server fails every call: once every watch loop has been refused and has retried, the table
        # must be as it was. When the server is back, the router relists and catches up.
        lists_before = api.lists
        kept = {role: urls(table, role) for role in ("prefill", "decode")}
        api.outage()
        await until(lambda: every_watch_refused_twice(api), "every watch loop refused twice", within=20)
        assert {role: urls(table, role) for role in ("prefill", "decode")} == kept
        api.down = False
        api.put("endpointslices", endpoint_slice("pre-b", "prefill", "v2", ("10.1.0.7", "p-0", True)))
        await until(lambda: urls(table, "prefill") == ["http://10.1.0.7:8000"], "pre-b after the outage", within=15)
        assert api.lists > lists_before
        # Nothing the router asked for was beyond its Role: no Pod, no other ConfigMap.
        assert api.forbidden == []
    finally:
        await discovery.stop()
        api.close_watches()


async def test_topology_comes_from_the_discovery_config_map(fake_api: tuple[FakeApi, int]) -> None:
    """Slices name each engine's node; the operator's ConfigMap names the node's rack. The router reads that one
    ConfigMap by name (the only one its Role lets it read), follows its changes and keeps the last good content."""
    api, port = fake_api
    api.put("configmaps", topology_map({"node-x": {RACK: "r9"}}, name="somebody-elses"))
    api.put("endpointslices", endpoint_slice("pre-a", "prefill", "v1", ("10.1.0.1", "p-0", True)))
    api.put("endpointslices", endpoint_slice("dec-a", "decode", "v1", ("10.2.0.1", "d-0", True)))
    table = EndpointTable()
    discovery = KubernetesDiscovery(config(), table, api_client_factory=api_client_for(port))

    def rack(role: str) -> str | None:
        [state] = table.states(role)  # type: ignore[arg-type]
        return state.endpoint.topology.get(RACK)

    await discovery.start()
    try:
        # Engines are served before the topology is known: a rack only weighs a score.
        await until(lambda: len(table.states("decode")) == 1, "the engines, without a topology yet")
        assert rack("decode") is None
        assert table.states("decode")[0].endpoint.topology["kubernetes.io/hostname"] == "node-d-0"

        api.put("configmaps", topology_map({"node-p-0": {RACK: "r1"}, "node-d-0": {RACK: "r2"}}))
        await until(lambda: rack("decode") == "r2", "the decode engine's rack from the ConfigMap")
        assert rack("prefill") == "r1"

        # A malformed update keeps the last good labels; a good one replaces them.
        version = table.version
        api.put("configmaps", topology_map("{not json"))
        await rebuilt(table, version)
        assert (rack("prefill"), rack("decode")) == ("r1", "r2")
        api.put("configmaps", topology_map({"node-d-0": {RACK: "r1"}}))
        await until(lambda: rack("decode") == "r1" and rack("prefill") is None, "the moved rack")
        # Gone: no rack, and no Service proven the operator's any longer, so no engine either.
        api.delete("configmaps", DISCOVERY)
        await until(lambda: table.states("decode") == () == table.states("prefill"), "no engine without the ConfigMap")
        assert api.forbidden == []
    finally:
        await discovery.stop()
        api.close_watches()


async def test_without_a_discovery_config_map_the_router_reads_only_slices(fake_api: tuple[FakeApi, int]) -> None:
    """A hand-written configuration without the operator's ConfigMap: the selected slices are all there is."""
    api, port = fake_api
    api.put("endpointslices", endpoint_slice("dec-a", "decode", "v1", ("10.2.0.1", "d-0", True)))
    table = EndpointTable()
    plain = config().model_copy(update={"discovery_config_map": None, "prefill": None})
    discovery = KubernetesDiscovery(plain, table, api_client_factory=api_client_for(port))
    await discovery.start()
    try:
        await until(lambda: len(table.states("decode")) == 1, "the decode engine")
        version = table.version
        api.put("endpointslices", endpoint_slice("dec-a", "decode", "v1", ("10.2.0.1", "d-0", False)))
        await rebuilt(table, version)
        assert api.lists == 1 and api.forbidden == []  # one list (the decode slices), then only the watch
    finally:
        await discovery.stop()
        api.close_watches()


async def test_only_slices_of_services_the_operator_publishes_give_engines(fake_api: tuple[FakeApi, int]) -> None:
    """A tenant's Service carrying the pool's labels gets slices from the EndpointSlice controller like any other
    (here its managed-by label and its own UID): the router leaves them out and says so once. A Service the
    operator publishes later (a rollout's new value) is taken from the moment the ConfigMap lists it, and a pod in
    an owned Service's slice that is not a member of the pool's StatefulSet is left out."""
    api, port = fake_api
    api.put("endpointslices", endpoint_slice("dec-a", "decode", "v1", ("10.2.0.1", "svc-decode-0", True)))
    evil = endpoint_slice("evil-x", "decode", "v1", ("10.9.9.9", "evil", True))
    evil["metadata"]["labels"]["kubernetes.io/service-name"] = "evil"
    evil["metadata"]["ownerReferences"][0].update(name="evil", uid="uid-evil")
    api.put("endpointslices", evil)
    api.put("configmaps", topology_map({}, services={"svc-decode-v1": "uid-svc-decode-v1"}))
    table = EndpointTable()
    members = config()
    assert members.decode is not None
    members = members.model_copy(update={"decode": members.decode.model_copy(update={"statefulset": "svc-decode"})})
    discovery = KubernetesDiscovery(members, table, api_client_factory=api_client_for(port))
    await discovery.start()
    try:
        await until(lambda: urls(table, "decode") == ["http://10.2.0.1:8000"], "the owned Service's engine only")
        # A rollout: the new value's slice appears before the operator lists its Service, then is taken.
        api.put("endpointslices", endpoint_slice("dec-b", "decode", "v2", ("10.2.0.2", "svc-decode-1", True)))
        version = table.version
        api.put("endpointslices", endpoint_slice("dec-a", "decode", "v1", ("10.2.0.1", "svc-decode-0", True)))
        await rebuilt(table, version)
        assert urls(table, "decode") == ["http://10.2.0.1:8000"]
        api.put(
            "configmaps", topology_map({}, services={f"svc-decode-{v}": f"uid-svc-decode-{v}" for v in ("v1", "v2")})
        )
        await until(lambda: len(table.states("decode")) == 2, "the published Service's engine")
        # A pod of someone else's in an owned Service's slice (it copied the pool's labels): not a member.
        api.put("endpointslices", endpoint_slice("dec-b", "decode", "v2", ("10.2.0.2", "svc-decode-1", True),
                                                 ("10.9.9.8", "copycat", True)))  # fmt: skip
        version = table.version
        api.put("endpointslices", endpoint_slice("dec-a", "decode", "v1", ("10.2.0.1", "svc-decode-0", False)))
        await rebuilt(table, version)
        assert urls(table, "decode") == ["http://10.2.0.1:8000", "http://10.2.0.2:8000"]
        assert api.forbidden == []
    finally:
        await discovery.stop()
        api.close_watches()


def kubeconfig_for(port: int, folder: Path) -> str:
    """A kubeconfig naming the fake API server: what the router reads from $KUBECONFIG outside a pod."""
    path = folder / "kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                "users": [{"name": "router", "user": {}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "router"}}],
                "current-context": "fake",
            }
        )
    )
    return str(path)


LONG = "The history of the river valley settlements began with small farms. " * 30


async def complete(url: str) -> tuple[int, str, str]:
    """One PD-sized completion through the router: status, route header, body."""
    body = {"model": "sim-model", "prompt": LONG, "max_tokens": 2}
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(20)) as response,
    ):
        return response.status, response.headers.get("X-Pdserve-Route", ""), await response.text()


async def test_an_ejected_engine_serves_when_the_last_usable_one_starts_terminating(
    fake_api: tuple[FakeApi, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, router_server: Any
) -> None:
    """Issue 23, in the order the local cluster showed it (decode pods replaced under load): one decode engine
    fails a request and is ejected, which the budget allows because the other one is usable; then the other one's
    pod starts terminating (its slice says not ready). The ejected engine is Ready and the only one left: it must
    take the traffic, not leave every client with 503 until its open period ends (an hour here)."""
    api, port = fake_api
    async with (
        sim_in_process(role="prefill") as prefill,
        sim_in_process(role="decode") as d0,
        sim_in_process(role="decode") as d1,
    ):
        # Every engine listens on its own loopback port, so each has its own slice (a slice has one port).
        api.put("endpointslices", endpoint_slice("pre", "prefill", "v1", ("127.0.0.1", "p-0", True),
                                                 port=prefill.http_port))  # fmt: skip
        for name, sim in (("d-0", d0), ("d-1", d1)):
            api.put("endpointslices", endpoint_slice(name, "decode", "v1", ("127.0.0.1", name, True),
                                                     port=sim.http_port))  # fmt: skip
        monkeypatch.setenv("KUBECONFIG", kubeconfig_for(port, tmp_path))
        breaker = CircuitBreakerConfig(failure_threshold=1, open_seconds=3600)
        settings = config(served_model_name="sim-model", circuit_breaker=breaker, engine_metrics_interval_seconds=0.0)
        async with router_server(settings) as (url, router):
            table = router.table
            await until(lambda: len(table.usable("decode")) == 2 and len(table.usable("prefill")) == 1, "3 engines")

            # d-1 fails a request (a 500, as a failed KV pull answers): ejected, and the request retried on d-0.
            await set_faults(d1.url, fail_next=1, fail_status=500)
            [busy] = [state for state in table.states("decode") if state.url == d0.url]
            busy.in_flight += 1000  # d-1 is the scheduler's first choice
            status, route, text = await complete(url)
            busy.in_flight -= 1000
            assert (status, route) == (200, "pd"), text
            exposition = await scrape(router.metrics_url)
            assert metric_value(exposition, "pdserve_router_endpoint_ejections_total", role="decode") == 1
            assert [state.url for state in table.usable("decode")] == [d0.url]

            # d-0's pod is deleted: its endpoint turns terminating (not ready, still serving its requests).
            version = table.version
            terminating = endpoint_slice("d-0", "decode", "v1", ("127.0.0.1", "d-0", False), port=d0.http_port)
            terminating["endpoints"][0]["conditions"] = {"ready": False, "serving": True, "terminating": True}
            api.put("endpointslices", terminating)
            await rebuilt(table, version)

            status, route, text = await complete(url)
            assert (status, route) == (200, "pd"), text
            assert await requests_seen(d1.url) == 2  # the failed request, then this one
            exposition = await scrape(router.metrics_url)
            assert metric_value(exposition, "pdserve_router_endpoint_up", role="decode", endpoint="d-1") == 1
