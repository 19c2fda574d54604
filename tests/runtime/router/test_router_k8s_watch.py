"""Kubernetes discovery against a small fake API server on loopback: list, watch, joins, outages.

The fake implements just the list and watch calls the `kubernetes` client makes for EndpointSlices and Pods
(JSON lists with a resourceVersion, newline-delimited watch events), so the real client code, the watch
threads and the hand-over to the event loop are all exercised without a cluster.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest
from aiohttp import web

from pdserve.api.router_config import EndpointSelector, RouterConfig
from pdserve_runtime.router.discovery.kubernetes import KubernetesDiscovery
from pdserve_runtime.router.endpoints import EndpointTable

pytestmark = pytest.mark.timeout(60)

NS = "llm"
KV = "pdserve.io/kv-compat"


class FakeApi:
    """Objects by collection, a global resourceVersion, and open watch streams."""

    def __init__(self) -> None:
        self.version = 1
        self.objects: dict[str, dict[str, dict[str, Any]]] = {"endpointslices": {}, "pods": {}}
        self.watchers: list[tuple[str, str | None, asyncio.Queue[dict[str, Any] | None]]] = []
        self.lists = 0

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
        for watched, selector, queue in self.watchers:
            if watched == collection and _matches(obj, selector):
                queue.put_nowait({"type": kind, "object": obj})

    def close_watches(self) -> None:
        for _, _, queue in self.watchers:
            queue.put_nowait(None)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        collection = request.match_info["collection"]
        selector = request.query.get("labelSelector")
        if request.query.get("watch") in ("true", "1", "True"):
            queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
            entry = (collection, selector, queue)
            self.watchers.append(entry)
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            await response.prepare(request)
            try:
                while (event := await queue.get()) is not None:
                    await response.write(json.dumps(event).encode() + b"\n")
            finally:
                self.watchers.remove(entry)
            return response
        self.lists += 1
        items = [obj for obj in self.objects[collection].values() if _matches(obj, selector)]
        return web.json_response({"metadata": {"resourceVersion": str(self.version)}, "items": items})


def _matches(obj: dict[str, Any], selector: str | None) -> bool:
    if not selector:
        return True
    key, _, value = selector.partition("=")
    return bool(obj["metadata"].get("labels", {}).get(key) == value)


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


async def until(check: Callable[[], bool], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while True:
        if check():
            return
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def serve_fake(api: FakeApi, port: int) -> web.AppRunner:
    app = web.Application()
    app.router.add_get("/api/v1/namespaces/{ns}/{collection}", api.handle)
    app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/{ns}/{collection}", api.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


@pytest.fixture
async def fake_api(unused_tcp_port: int) -> AsyncIterator[tuple[FakeApi, int, Callable[[], Coroutine[Any, Any, None]]]]:
    api = FakeApi()
    runners = [await serve_fake(api, unused_tcp_port)]

    async def outage_then_recover() -> None:
        api.close_watches()
        await runners[0].cleanup()
        await asyncio.sleep(1.0)  # the watch threads fail, back off, retry against a closed port
        runners[0] = await serve_fake(api, unused_tcp_port)

    try:
        yield api, unused_tcp_port, outage_then_recover
    finally:
        api.close_watches()
        await runners[0].cleanup()


def urls(table: EndpointTable, role: str, usable: bool = False) -> list[str]:
    states = table.usable(role) if usable else table.states(role)  # type: ignore[arg-type]
    return sorted(state.url for state in states)


async def test_discovery_follows_slices_and_pods_and_survives_an_api_outage(
    fake_api: tuple[FakeApi, int, Callable[[], Coroutine[Any, Any, None]]],
) -> None:
    from kubernetes import client

    api, port, outage = fake_api
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
        await until(lambda: urls(table, "prefill") == ["http://10.1.0.1:8000"] and len(table.states("decode")) == 1)
        assert table.states("prefill")[0].endpoint.kv_compat == "v1"

        # Scale up: an endpoint whose pod is not known yet waits for the pod watch.
        api.put(
            "endpointslices",
            endpoint_slice("dec-x", "svc-decode", ("10.2.0.1", "d-0", True), ("10.2.0.2", "d-1", True)),
        )
        await asyncio.sleep(0.3)
        assert urls(table, "decode") == ["http://10.2.0.1:8000"]
        api.put("pods", pod("d-1", "v2"))
        await until(lambda: len(table.states("decode")) == 2)
        by_url = {state.url: state.endpoint.kv_compat for state in table.states("decode")}
        assert by_url == {"http://10.2.0.1:8000": "v1", "http://10.2.0.2:8000": "v2"}

        # Readiness flips and deletions.
        api.put(
            "endpointslices",
            endpoint_slice("dec-x", "svc-decode", ("10.2.0.1", "d-0", False), ("10.2.0.2", "d-1", True)),
        )
        await until(lambda: urls(table, "decode", usable=True) == ["http://10.2.0.2:8000"])
        api.delete("endpointslices", "pre-x")
        await until(lambda: table.states("prefill") == ())

        # The API server goes away: the table is kept; when it returns, the router relists and catches up.
        lists_before = api.lists
        kept = urls(table, "decode")
        outage_task = asyncio.create_task(outage())
        await asyncio.sleep(0.5)
        assert urls(table, "decode") == kept
        await outage_task
        api.put("endpointslices", endpoint_slice("pre-y", "svc-prefill", ("10.1.0.7", "p-0", True)))
        await until(lambda: urls(table, "prefill") == ["http://10.1.0.7:8000"], within=15)
        assert api.lists > lists_before
    finally:
        await discovery.stop()
        api.close_watches()
