"""The other router replicas: how many share every engine's budget (`admission`: each takes budget / N).

A replica counts the ready endpoints of its own Service's EndpointSlices (`admission.peers`, which the renderer
points at `kubernetes.io/service-name=<router Service>`; the router's Role already lists and watches
EndpointSlices in its namespace). An endpoint counts while its conditions allow traffic (`ready` and `serving`
not false, `terminating` not true: an absent condition counts as yes, as the API says); addresses are counted
once across slices. A replica that is not ready yet gets no traffic from the Service, so it need not count itself;
one that is counts itself among the ready endpoints. Until the first list is in, the configured
`routerReplicas` stands.

Why not coordinate: the shares need no traffic between replicas and no shared state; the price is a split that is
briefly wrong while a replica joins or leaves (until every replica's watch has seen it, typically milliseconds),
which the engine-reported load corrects (`admission.has_room`, `others`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pdserve.api.router_config import RouterPeers
from pdserve_runtime.router.discovery.listwatch import ListWatch, Objects


def ready_replicas(slices: Iterable[Mapping[str, Any]]) -> int:
    """Ready router endpoints across the Service's EndpointSlices, each address once (pure)."""
    ready: set[str] = set()
    for slice_obj in slices:
        for entry in slice_obj.get("endpoints") or ():
            conditions = entry.get("conditions") or {}
            if (
                conditions.get("ready") is False
                or conditions.get("serving") is False
                or conditions.get("terminating") is True
            ):
                continue
            ready.update(entry.get("addresses") or ())
    return len(ready)


class PeerWatch:
    """Keeps `on_count(N)` told of the ready router replicas (N >= 1)."""

    def __init__(self, peers: RouterPeers, on_count: Callable[[int], None], api_client: Any) -> None:
        from kubernetes import client

        self._on_count = on_count
        self._watch = ListWatch(
            "router-peers",
            client.DiscoveryV1Api(api_client).list_namespaced_endpoint_slice,
            peers.namespace,
            {"label_selector": peers.label_selector},
            self._changed,
        )

    def start(self) -> None:
        self._watch.start()

    def stop(self) -> None:
        self._watch.stop()

    def _changed(self, objects: Objects) -> None:
        self._on_count(max(1, ready_replicas(objects.values())))
