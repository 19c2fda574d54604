"""Kubernetes discovery against a small fake API server on loopback: list, watch, joins, outages.

The fake implements just the list and watch calls the `kubernetes` client makes for EndpointSlices and Pods
(JSON lists with a resourceVersion, newline-delimited watch events that resume from the resourceVersion a
watch asks for), so the real client code, the watch threads and the hand-over to the event loop are all
exercised without a cluster.

Nothing here sleeps and then asserts that something did not happen: the test waits for a counted event (the
endpoint table's version moving on, the fake counting the calls it refused) and then asserts.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import web

from pdserve.api.router_config import EndpointSelector, RouterConfig
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
        self.objects: dict[str, dict[str, dict[str, Any]]] = {"endpointslices": {}, "pods": {}}
        self.history: list[Event] = []
        self.watchers: list[tuple[str, str | None, asyncio.Queue[dict[str, Any] | None]]] = []
        self.lists = 0
        self.down = False
        self.refused: dict[tuple[str, str | None], int] = {}

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
        for watched, selector, queue in self.watchers:
            if watched == collection and _matches(obj, selector):
                queue.put_nowait({"type": kind, "object": obj})

    def close_watches(self) -> None:
        for _, _, queue in self.watchers:
            queue.put_nowait(None)

    def outage(self) -> None:
        """From now on every call fails with 503, and open watches end."""
        self.down = True
        self.close_watches()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        collection = request.match_info["collection"]
        selector = request.query.get("labelSelector")
        if self.down:
            key = (collection, selector)
            self.refused[key] = self.refused.get(key, 0) + 1
            return web.json_response({"kind": "Status", "status": "Failure", "code": 503}, status=503)
        if request.query.get("watch") in ("true", "1", "True"):
            # Replay what happened after the version the watch starts from, then follow live events; both are
            # set up before the first await, so no event can fall between them.
            since = int(request.query.get("resourceVersion") or self.version)
            queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
            for version, watched, kind, obj in self.history:
                if version > since and watched == collection and _matches(obj, selector):
                    queue.put_nowait({"type": kind, "object": obj})
            entry = (collection, selector, queue)
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
        items = [obj for obj in self.objects[collection].values() if _matches(obj, selector)]
        return web.json_response({"metadata": {"resourceVersion": str(self.version)}, "items": items})


_REQUIREMENT = re.compile(r"^\s*(!?)([\w./-]+)\s*(?:(==|=|!=)\s*([\w./-]*)|\s+(in|notin)\s*\(([^)]*)\))?\s*$")


def _matches(obj: dict[str, Any], selector: str | None) -> bool:
    """Kubernetes label-selector matching for what a router might send: `k=v`, `k==v`, `k!=v`, `k`, `!k`,
    `k in (a,b)`, `k notin (a,b)`, comma-separated."""
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


def pod(name: str, kv: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS, "labels": {KV: kv}}}


def endpoint_slice(name: str, service: str, *endpoints: tuple[str, str, bool]) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": NS, "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
        "endpoints": [
            {"addresses": [ip], "conditions": {"ready": ready}, "targetRef": {"kind": "Pod", "name": pod_name}}
            for ip, pod_name, ready in endpoints
        ],
    }


@pytest.fixture
async def fake_api() -> AsyncIterator[tuple[FakeApi, int]]:
    api = FakeApi()
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
    """Each discovery watch loop (the two slice selectors and the pods) has been refused, backed off and retried."""
    slices = {selector for (kind, selector), n in api.refused.items() if kind == "endpointslices" and n >= 2}
    pods = [n for (kind, _), n in api.refused.items() if kind == "pods"]
    return len(slices) == 2 and bool(pods) and min(pods) >= 2


async def test_discovery_follows_slices_and_pods_and_survives_an_api_outage(fake_api: tuple[FakeApi, int]) -> None:
    from kubernetes import client

    api, port = fake_api
    api.put("pods", pod("p-0", "v1"))
    api.put("pods", pod("d-0", "v1"))
    api.put("endpointslices", endpoint_slice("pre-x", "svc-prefill", ("10.1.0.1", "p-0", True)))
    api.put("endpointslices", endpoint_slice("dec-x", "svc-decode", ("10.2.0.1", "d-0", True)))
    api.put("endpointslices", endpoint_slice("other", "unrelated", ("10.9.0.1", "p-0", True)))
    config = RouterConfig(
        served_model_name="m",
        prefill=EndpointSelector(namespace=NS, service_name="svc-prefill"),
        decode=EndpointSelector(namespace=NS, service_name="svc-decode"),
    )
    table = EndpointTable()

    def api_client() -> Any:
        return client.ApiClient(client.Configuration(host=f"http://127.0.0.1:{port}"))

    discovery = KubernetesDiscovery(config, table, api_client_factory=api_client)
    await discovery.start()
    try:
        await until(
            lambda: urls(table, "prefill") == ["http://10.1.0.1:8000"] and len(table.states("decode")) == 1,
            "the first lists in the table",
        )
        assert table.states("prefill")[0].endpoint.kv_compat == "v1"

        # Scale up: an endpoint whose pod is not known yet waits for the pod watch. Once discovery has applied
        # the slice change (the table's version moved on), the new address must still be missing.
        version = table.version
        api.put(
            "endpointslices",
            endpoint_slice("dec-x", "svc-decode", ("10.2.0.1", "d-0", True), ("10.2.0.2", "d-1", True)),
        )
        await rebuilt(table, version)
        assert urls(table, "decode") == ["http://10.2.0.1:8000"]
        api.put("pods", pod("d-1", "v2"))
        await until(lambda: len(table.states("decode")) == 2, "d-1 in the table once its pod is known")
        by_url = {state.url: state.endpoint.kv_compat for state in table.states("decode")}
        assert by_url == {"http://10.2.0.1:8000": "v1", "http://10.2.0.2:8000": "v2"}

        # Readiness flips and deletions.
        api.put(
            "endpointslices",
            endpoint_slice("dec-x", "svc-decode", ("10.2.0.1", "d-0", False), ("10.2.0.2", "d-1", True)),
        )
        await until(lambda: urls(table, "decode", usable=True) == ["http://10.2.0.2:8000"], "d-0 not ready")
        api.delete("endpointslices", "pre-x")
        await until(lambda: table.states("prefill") == (), "the prefill slice deleted")

        # The API server fails every call: once every watch loop has been refused and has retried, the table
        # must be as it was. When the server is back, the router relists and catches up.
        lists_before = api.lists
        kept = {role: urls(table, role) for role in ("prefill", "decode")}
        api.outage()
        await until(lambda: every_watch_refused_twice(api), "every watch loop refused twice", within=20)
        assert {role: urls(table, role) for role in ("prefill", "decode")} == kept
        api.down = False
        api.put("endpointslices", endpoint_slice("pre-y", "svc-prefill", ("10.1.0.7", "p-0", True)))
        await until(lambda: urls(table, "prefill") == ["http://10.1.0.7:8000"], "pre-y after the outage", within=15)
        assert api.lists > lists_before
    finally:
        await discovery.stop()
        api.close_watches()


async def test_the_pod_watch_sees_only_the_pools_pods(fake_api: tuple[FakeApi, int]) -> None:
    """With `podLabelSelector` the router lists and watches only its pools' pods (not every pod of the namespace):
    an endpoint whose pod is outside the selector is never joined, however often the table is rebuilt."""
    from kubernetes import client

    api, port = fake_api
    decode_pod = pod("d-0", "v1")
    decode_pod["metadata"]["labels"]["pdserve.io/role"] = "decode"
    api.put("pods", decode_pod)
    api.put("pods", pod("x-0", "v1"))  # another workload's pod in the same namespace
    api.put("endpointslices", endpoint_slice("dec-x", "svc-decode", ("10.2.0.1", "d-0", True)))
    selector = EndpointSelector(namespace=NS, service_name="svc-decode", pod_label_selector="pdserve.io/role=decode")
    config = RouterConfig(served_model_name="m", decode=selector)
    table = EndpointTable()

    def api_client() -> Any:
        return client.ApiClient(client.Configuration(host=f"http://127.0.0.1:{port}"))

    discovery = KubernetesDiscovery(config, table, api_client_factory=api_client)
    await discovery.start()
    try:
        await until(lambda: urls(table, "decode") == ["http://10.2.0.1:8000"], "d-0 joined with its pod")
        version = table.version
        api.put(
            "endpointslices",
            endpoint_slice("dec-x", "svc-decode", ("10.2.0.1", "d-0", True), ("10.2.0.9", "x-0", True)),
        )
        await rebuilt(table, version)
        api.put("pods", pod("x-0", "v2"))  # a change to the outside pod reaches no watch of the router
        version = table.version
        api.put("endpointslices", endpoint_slice("dec-y", "svc-decode"))
        await rebuilt(table, version)
        assert urls(table, "decode") == ["http://10.2.0.1:8000"]
    finally:
        await discovery.stop()
