"""The router side of the published controls (router control ConfigMap: the PD threshold and the TTFT target) and the
router replica count, pure."""

from __future__ import annotations

import json
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from pdserve.api.router_config import AdmissionConfig, RoutingPolicyConfig
from pdserve_dev.testing.metrics import metric_value
from pdserve_runtime.router.control import Controls, ControlsCollector, parse_control
from pdserve_runtime.router.discovery.peers import ready_replicas
from pdserve_runtime.router.endpoints import EndpointTable
from pdserve_runtime.router.gate import Gate
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
        (control(ttftTargetSeconds=0), "ttftTargetSeconds: Input should be greater than 0"),
    ],
)
def test_a_malformed_control_says_why(obj: dict[str, Any], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_control(obj)


def test_the_threshold_follows_the_control_and_falls_back_to_the_static_one() -> None:
    plans = scheduler(static=256)
    controls = Controls(plans)
    registry = CollectorRegistry()
    registry.register(ControlsCollector(plans))

    def shown() -> float:
        from prometheus_client import generate_latest

        return metric_value(generate_latest(registry).decode(), "pdserve_router_disaggregation_threshold")

    assert (plans.threshold, shown()) == (256, 256)
    controls.apply({"llm-router-control": control(disaggregationThreshold=2048, reason="decode has headroom")})
    assert (plans.threshold, controls.source, shown()) == (2048, "control", 2048)
    controls.apply({"llm-router-control": control(disaggregationThreshold="x")})  # malformed: static
    assert (plans.threshold, controls.source) == (256, "static")
    controls.apply({"llm-router-control": control(disaggregationThreshold=0)})
    assert plans.threshold == 0
    controls.apply({"llm-router-control": control(ttftTargetSeconds=0.5)})  # no threshold published: static
    assert (plans.threshold, controls.source) == (256, "static")
    controls.apply({"llm-router-control": control(disaggregationThreshold=0)})
    controls.apply({})  # deleted: static
    assert (plans.threshold, controls.source, shown()) == (256, "static", 256)


def queue_gate(plans: Scheduler, configured_ttft: float | None = None) -> Gate:
    admission = AdmissionConfig(prefill_budget_tokens=1000, ttft_target_seconds=configured_ttft)
    return Gate(admission, plans.table, plans, CollectorRegistry(), fallback_to_decode=True, retry_after_s=1)


def test_the_ttft_target_follows_the_control_and_gives_new_requests_their_deadline() -> None:
    """`spec.slo` reaches the routers through the control ConfigMap (a change rolls no router): the queue's
    deadlines come from the published target, else the configured one, else there are none."""
    plans = scheduler()
    gate = queue_gate(plans)
    controls = Controls(plans, gate=gate)
    registry = CollectorRegistry()
    registry.register(ControlsCollector(plans, gate))

    def shown() -> float | None:
        from prometheus_client import generate_latest

        text = generate_latest(registry).decode()
        return metric_value(text, "pdserve_router_ttft_target_seconds") if "ttft_target_seconds " in text else None

    def deadline_in(now: float) -> float | None:
        pushed = gate.queue.push(object(), client="c", pool="prefill", tokens=10, now=now)  # type: ignore[arg-type]
        assert pushed.ticket is not None
        return None if pushed.ticket.deadline is None else pushed.ticket.deadline - now

    assert (gate.ttft_target_s, shown(), deadline_in(0.0)) == (None, None, None)
    controls.apply({"llm-router-control": control(ttftTargetSeconds=0.8, disaggregationThreshold=512)})
    assert (gate.ttft_target_s, shown(), deadline_in(0.0), plans.threshold) == (0.8, 0.8, 0.8, 512)
    controls.apply({"llm-router-control": control(ttftTargetSeconds=0.4)})  # the SLO tightened
    assert (gate.ttft_target_s, deadline_in(0.0), plans.threshold) == (0.4, 0.4, 256)
    controls.apply({})
    assert (gate.ttft_target_s, shown()) == (None, None)
    by_hand = queue_gate(plans, configured_ttft=1.5)  # a router configured by hand
    Controls(plans, gate=by_hand).apply({"llm-router-control": control(reason="nothing published")})
    assert by_hand.ttft_target_s == 1.5


def owned_by(obj: dict[str, Any], kind: str, uid: str, *, controller: bool = True) -> dict[str, Any]:
    reference = {"apiVersion": "pdserve.io/v1alpha1", "kind": kind, "name": "llm", "uid": uid, "controller": controller}
    return {**obj, "metadata": {**obj["metadata"], "ownerReferences": [reference]}}


def test_only_the_pdservices_own_control_moves_the_threshold() -> None:
    """A namespace user with ConfigMap rights makes (or replaces) the control ConfigMap: without the PDService's
    controller reference (its UID) it is ignored, as if absent."""
    plans = scheduler(static=256)
    gate = queue_gate(plans, configured_ttft=2.0)
    controls = Controls(plans, owner_uid="pds-uid", gate=gate)
    published = control(disaggregationThreshold=4096, ttftTargetSeconds=0.1, reason="prefill short")
    for forged in (
        published,
        owned_by(published, "PDService", "other-uid"),
        owned_by(published, "PDService", "pds-uid", controller=False),
        owned_by(published, "Deployment", "pds-uid"),
    ):
        controls.apply({"llm-router-control": forged})
        assert (plans.threshold, controls.source, gate.ttft_target_s) == (256, "static", 2.0), forged["metadata"]
    controls.apply({"llm-router-control": owned_by(published, "PDService", "pds-uid")})
    assert (plans.threshold, controls.source, gate.ttft_target_s) == (4096, "control", 0.1)
    controls.apply({"llm-router-control": published})  # replaced by someone else: static again
    assert (plans.threshold, controls.source, gate.ttft_target_s) == (256, "static", 2.0)


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
