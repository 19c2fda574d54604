"""The router side of the published PD threshold (router control ConfigMap) and the router replica count, pure."""

from __future__ import annotations

import json
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from pdserve.api.router_config import RoutingPolicyConfig
from pdserve_dev.testing.metrics import metric_value
from pdserve_runtime.router.control import Threshold, ThresholdCollector, parse_control
from pdserve_runtime.router.discovery.peers import ready_replicas
from pdserve_runtime.router.endpoints import EndpointTable
from pdserve_runtime.router.policy.scheduler import Scheduler
from pdserve_runtime.router.prefix import PrefixTracker


def config_map(data: dict[str, str] | None) -> dict[str, Any]:
    return {"metadata": {"name": "llm-router-control"}, "data": data}


def control(**fields: object) -> dict[str, Any]:
    return config_map({"control.json": json.dumps(fields)})


def scheduler(static: int = 256) -> Scheduler:
    return Scheduler(
        EndpointTable(),
        PrefixTracker(max_blocks=10, ttl_seconds=1, block_size=16),
        RoutingPolicyConfig(disaggregation_threshold_tokens=static),
    )


def test_a_published_threshold_parses_and_unknown_members_are_ignored() -> None:
    found = parse_control(
        control(disaggregationThreshold=1024, reason="prefill saturated", decidedAt="2026-12-01T10:00:00Z", next=1)
    )
    assert (found.disaggregation_threshold, found.reason) == (1024, "prefill saturated")


@pytest.mark.parametrize(
    ("obj", "why"),
    [
        (config_map(None), "no key control.json"),
        (config_map({"other": "{}"}), "no key control.json"),
        (config_map({"control.json": "{not json"}), "control.json is not a router control"),
        (control(disaggregationThreshold=-1), "disaggregationThreshold: Input should be greater than or equal to 0"),
        (control(disaggregationThreshold="many"), "disaggregationThreshold"),
        (control(reason="no threshold"), "disaggregationThreshold: Field required"),
    ],
)
def test_a_malformed_control_says_why(obj: dict[str, Any], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_control(obj)


def test_the_threshold_follows_the_control_and_falls_back_to_the_static_one() -> None:
    plans = scheduler(static=256)
    threshold = Threshold(plans)
    registry = CollectorRegistry()
    registry.register(ThresholdCollector(plans))

    def shown() -> float:
        from prometheus_client import generate_latest

        return metric_value(generate_latest(registry).decode(), "pdserve_router_disaggregation_threshold")

    assert (plans.threshold, shown()) == (256, 256)
    threshold.apply({"llm-router-control": control(disaggregationThreshold=2048, reason="decode has headroom")})
    assert (plans.threshold, threshold.source, shown()) == (2048, "control", 2048)
    threshold.apply({"llm-router-control": control(disaggregationThreshold="x")})  # malformed: static
    assert (plans.threshold, threshold.source) == (256, "static")
    threshold.apply({"llm-router-control": control(disaggregationThreshold=0)})
    assert plans.threshold == 0
    threshold.apply({})  # deleted: static
    assert (plans.threshold, threshold.source, shown()) == (256, "static", 256)


def owned_by(obj: dict[str, Any], kind: str, uid: str, *, controller: bool = True) -> dict[str, Any]:
    reference = {"apiVersion": "pdserve.io/v1alpha1", "kind": kind, "name": "llm", "uid": uid, "controller": controller}
    return {**obj, "metadata": {**obj["metadata"], "ownerReferences": [reference]}}


def test_only_the_pdservices_own_control_moves_the_threshold() -> None:
    """A namespace user with ConfigMap rights makes (or replaces) the control ConfigMap: without the PDService's
    controller reference (its UID) it is ignored, as if absent."""
    plans = scheduler(static=256)
    threshold = Threshold(plans, owner_uid="pds-uid")
    published = control(disaggregationThreshold=4096, reason="prefill short")
    for forged in (
        published,
        owned_by(published, "PDService", "other-uid"),
        owned_by(published, "PDService", "pds-uid", controller=False),
        owned_by(published, "Deployment", "pds-uid"),
    ):
        threshold.apply({"llm-router-control": forged})
        assert (plans.threshold, threshold.source) == (256, "static"), forged["metadata"]
    threshold.apply({"llm-router-control": owned_by(published, "PDService", "pds-uid")})
    assert (plans.threshold, threshold.source) == (4096, "control")
    threshold.apply({"llm-router-control": published})  # replaced by someone else: static again
    assert (plans.threshold, threshold.source) == (256, "static")


def endpoint(address: str, **conditions: bool) -> dict[str, Any]:
    return {"addresses": [address], "conditions": conditions}


@pytest.mark.parametrize(
    ("slices", "expected"),
    [
        ([], 0),
        ([{"endpoints": [endpoint("10.0.0.1", ready=True), endpoint("10.0.0.2")]}], 2),  # absent: yes
        ([{"endpoints": [endpoint("10.0.0.1", ready=False), endpoint("10.0.0.2", ready=True)]}], 1),
        ([{"endpoints": [endpoint("10.0.0.1", ready=True, serving=True, terminating=True)]}], 0),
        ([{"endpoints": [endpoint("10.0.0.1", ready=True, serving=False)]}], 0),
        ([{"endpoints": [endpoint("10.0.0.1")]}, {"endpoints": [endpoint("10.0.0.1"), endpoint("10.0.0.3")]}], 2),
        ([{"endpoints": None}], 0),
    ],
)
def test_ready_router_replicas_in_the_services_slices(slices: list[dict[str, Any]], expected: int) -> None:
    assert ready_replicas(slices) == expected
