"""Kubernetes discovery, pure part: EndpointSlices (+ published node labels) -> endpoints. Table-driven."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve_runtime.router.discovery.kubernetes import endpoints_from_slice, parse_node_topology, pool_endpoints

KV = "pdserve.io/kv-compat"
RACK = "example.com/rack"
ZONE = "topology.kubernetes.io/zone"
HOST = "kubernetes.io/hostname"
NODES = {"n1": {RACK: "r1"}, "n2": {RACK: "r2", "other": "x"}}


def slice_of(
    *endpoints: dict[str, Any], kv: str | None = "abc", port: int = 8000, port_name: str = "http", kind: str = "IPv4"
) -> dict[str, Any]:
    labels = {"kubernetes.io/service-name": "svc-decode-abc"}
    if kv is not None:
        labels[KV] = kv
    return {
        "metadata": {"name": "s", "labels": labels},
        "addressType": kind,
        "ports": [{"name": "metrics", "port": 9000}, {"name": port_name, "port": port}],
        "endpoints": list(endpoints),
    }


def ep(address: str, pod: str | None, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"addresses": [address], **extra}
    if pod is not None:
        out["targetRef"] = {"kind": "Pod", "name": pod, "namespace": "ns"}
    return out


@pytest.mark.parametrize(
    ("slice_obj", "expected"),
    [
        # url, kv-compat (the slice's label), ready, topology (zone and node from the slice, rack from the nodes)
        (slice_of(ep("10.0.0.1", "p0")), [("http://10.0.0.1:8000", "abc", True, {})]),
        (
            slice_of(ep("10.0.0.2", "p1", conditions={"ready": False}, zone="z1", nodeName="n1"), kv="def"),
            [("http://10.0.0.2:8000", "def", False, {ZONE: "z1", HOST: "n1", RACK: "r1"})],
        ),
        (
            slice_of(ep("10.0.0.3", "p0", conditions={"ready": None}, nodeName="n2")),
            [("http://10.0.0.3:8000", "abc", True, {HOST: "n2", RACK: "r2"})],  # only the configured labels
        ),
        # Scale-down: a terminating pod takes no new requests, whatever its Service publishes (ready is forced
        # true with publishNotReadyAddresses) and whether or not its engine still serves (its drain).
        (
            slice_of(ep("10.0.0.7", "p0", conditions={"ready": False, "serving": True, "terminating": True})),
            [("http://10.0.0.7:8000", "abc", False, {})],
        ),
        (
            slice_of(ep("10.0.0.8", "p0", conditions={"ready": True, "serving": True, "terminating": True})),
            [("http://10.0.0.8:8000", "abc", False, {})],
        ),
        (
            slice_of(ep("10.0.0.9", "p0", conditions={"ready": True, "serving": False, "terminating": False})),
            [("http://10.0.0.9:8000", "abc", False, {})],
        ),
        (
            slice_of(ep("10.0.0.10", "p0", conditions={"ready": True, "serving": True, "terminating": False})),
            [("http://10.0.0.10:8000", "abc", True, {})],
        ),
        (  # a node the topology does not list: no rack, the rest still known
            slice_of(ep("10.0.0.4", "p0", nodeName="n9", zone="z2")),
            [("http://10.0.0.4:8000", "abc", True, {ZONE: "z2", HOST: "n9"})],
        ),
        (slice_of(ep("10.0.0.5", None), kv=None), [("http://10.0.0.5:8000", None, True, {})]),  # unlabelled slice
        (slice_of(ep("fd00::1", "p0"), kind="IPv6"), [("http://[fd00::1]:8000", "abc", True, {})]),
        (slice_of(ep("engine.example", "p0"), kind="FQDN"), []),
        (slice_of(ep("10.0.0.6", "p0"), port_name="grpc"), []),  # no port named http
        ({"metadata": {"name": "empty"}, "addressType": "IPv4", "ports": [{"name": "http", "port": 80}]}, []),
    ],
)
def test_endpoints_from_slice(slice_obj: dict[str, Any], expected: list[tuple[Any, ...]]) -> None:
    found = endpoints_from_slice(
        slice_obj, role="decode", port_name="http", kv_compat_label=KV, topology_labels=[RACK], nodes=NODES
    )
    assert [(e.url, e.kv_compat, e.ready, dict(e.topology)) for e in found] == expected
    assert all(e.role == "decode" for e in found)


def test_pool_merges_slices_and_prefers_ready_copies() -> None:
    first = slice_of(ep("10.0.0.1", "p0", conditions={"ready": False}), ep("10.0.0.2", "p1"))
    second = slice_of(ep("10.0.0.1", "p0"))
    found = pool_endpoints(
        [first, second], role="prefill", port_name="http", kv_compat_label=KV, topology_labels=[], nodes={}
    )
    assert [(e.url, e.ready, e.name) for e in found] == [
        ("http://10.0.0.1:8000", True, "p0"),
        ("http://10.0.0.2:8000", True, "p1"),
    ]


def test_an_address_listed_under_two_kv_compat_values_is_left_out() -> None:
    """A pod whose label was edited by hand sits in two Services' slices for a moment: either value is a guess."""
    old = slice_of(ep("10.0.0.1", "p0"), ep("10.0.0.2", "p1"), kv="abc")
    new = slice_of(ep("10.0.0.1", "p0"), kv="def")
    found = pool_endpoints(
        [old, new], role="prefill", port_name="http", kv_compat_label=KV, topology_labels=[], nodes={}
    )
    assert [(e.url, e.kv_compat) for e in found] == [("http://10.0.0.2:8000", "abc")]


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"nodes.json": '{"nodes": {"n1": {"r": "a"}}}'}, {"n1": {"r": "a"}}),
        ({"nodes.json": '{"nodes": {}}'}, {}),
        ({"nodes.json": "{}"}, {}),
        ({"nodes.json": '{"nodes": {"n1": {"r": 3}}}'}, ValueError),
        ({"nodes.json": "not json"}, ValueError),
        ({"other": "{}"}, ValueError),
        (None, ValueError),
    ],
)
def test_parse_node_topology(data: dict[str, str] | None, expected: Any) -> None:
    config_map = {"metadata": {"name": "t"}, "data": data}
    if expected is ValueError:
        with pytest.raises(ValueError, match=r"nodes\.json"):
            parse_node_topology(config_map)
    else:
        assert parse_node_topology(config_map) == expected
