"""Kubernetes discovery, pure part: EndpointSlices + pod labels -> endpoints. Table-driven."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve_runtime.router.discovery.kubernetes import endpoints_from_slice, pool_endpoints

KV = "pdserve.io/kv-compat"
RACK = "example.com/rack"


def slice_of(
    *endpoints: dict[str, Any], port: int = 8000, port_name: str = "http", kind: str = "IPv4"
) -> dict[str, Any]:
    return {
        "metadata": {"name": "s"},
        "addressType": kind,
        "ports": [{"name": "metrics", "port": 9000}, {"name": port_name, "port": port}],
        "endpoints": list(endpoints),
    }


def ep(address: str, pod: str | None, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"addresses": [address], **extra}
    if pod is not None:
        out["targetRef"] = {"kind": "Pod", "name": pod, "namespace": "ns"}
    return out


PODS = {"p0": {KV: "abc", RACK: "r1"}, "p1": {KV: "def"}}


@pytest.mark.parametrize(
    ("slice_obj", "expected"),
    [
        # url, kv-compat, ready, topology
        (slice_of(ep("10.0.0.1", "p0")), [("http://10.0.0.1:8000", "abc", True, {RACK: "r1"})]),
        (
            slice_of(ep("10.0.0.2", "p1", conditions={"ready": False}, zone="z1", nodeName="n1")),
            [
                (
                    "http://10.0.0.2:8000",
                    "def",
                    False,
                    {"topology.kubernetes.io/zone": "z1", "kubernetes.io/hostname": "n1"},
                )
            ],
        ),
        (
            slice_of(ep("10.0.0.3", "p0", conditions={"ready": None})),
            [("http://10.0.0.3:8000", "abc", True, {RACK: "r1"})],
        ),
        # Scale-down: a terminating pod takes no new requests, whatever its Service publishes (ready is forced
        # true with publishNotReadyAddresses) and whether or not its engine still serves (its drain).
        (
            slice_of(ep("10.0.0.7", "p0", conditions={"ready": False, "serving": True, "terminating": True})),
            [("http://10.0.0.7:8000", "abc", False, {RACK: "r1"})],
        ),
        (
            slice_of(ep("10.0.0.8", "p0", conditions={"ready": True, "serving": True, "terminating": True})),
            [("http://10.0.0.8:8000", "abc", False, {RACK: "r1"})],
        ),
        (
            slice_of(ep("10.0.0.9", "p0", conditions={"ready": True, "serving": False, "terminating": False})),
            [("http://10.0.0.9:8000", "abc", False, {RACK: "r1"})],
        ),
        (
            slice_of(ep("10.0.0.10", "p0", conditions={"ready": True, "serving": True, "terminating": False})),
            [("http://10.0.0.10:8000", "abc", True, {RACK: "r1"})],
        ),
        (slice_of(ep("10.0.0.4", "unknown-pod")), []),  # wait for the pod watch
        (slice_of(ep("10.0.0.5", None)), [("http://10.0.0.5:8000", None, True, {})]),  # not a pod: no labels
        (slice_of(ep("fd00::1", "p0"), kind="IPv6"), [("http://[fd00::1]:8000", "abc", True, {RACK: "r1"})]),
        (slice_of(ep("engine.example", "p0"), kind="FQDN"), []),
        (slice_of(ep("10.0.0.6", "p0"), port_name="grpc"), []),  # no port named http
        ({"metadata": {"name": "empty"}, "addressType": "IPv4", "ports": [{"name": "http", "port": 80}]}, []),
    ],
)
def test_endpoints_from_slice(slice_obj: dict[str, Any], expected: list[tuple[Any, ...]]) -> None:
    found = endpoints_from_slice(
        slice_obj, role="decode", port_name="http", pods=PODS, kv_compat_label=KV, topology_labels=[RACK]
    )
    assert [(e.url, e.kv_compat, e.ready, dict(e.topology)) for e in found] == expected
    assert all(e.role == "decode" for e in found)


def test_pool_merges_slices_and_prefers_ready_copies() -> None:
    first = slice_of(ep("10.0.0.1", "p0", conditions={"ready": False}), ep("10.0.0.2", "p1"))
    second = slice_of(ep("10.0.0.1", "p0"))
    found = pool_endpoints(
        [first, second], role="prefill", port_name="http", pods=PODS, kv_compat_label=KV, topology_labels=[]
    )
    assert [(e.url, e.ready, e.name) for e in found] == [
        ("http://10.0.0.1:8000", True, "p0"),
        ("http://10.0.0.2:8000", True, "p1"),
    ]
