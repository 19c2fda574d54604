"""The autoscaler's loops in the operator, against a fake of the operator's IO layer and a fake signal source.

What is under test here is the wiring, not the brain (the model and policy have their own tables): which
PDServices get a loop and when it stops (leadership, deletion, mode), what a tick writes (/scale, Events,
metrics, the report the reconcile turns into status) and how failures are retried. So the two outside parts are
fakes, and say so: `FakeKube` (pdserve_dev.testing.fake_kube) for the Kubernetes writes and `Scripted`, a signal
source that answers each tick with the signals a test scripts, built on the very target and pods the loop read
from the informer cache (the real collector against a real Prometheus is covered by test_autoscaler_collector.py
and, end to end, by tests/e2e/test_e2e_autoscaling.py).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import pytest
import yaml
from prometheus_client import CollectorRegistry

from pdserve.api.policy import DEFAULT_POLICY
from pdserve.api.router_config import RouterControl
from pdserve.api.settings import OperatorSettings
from pdserve_dev.testing.fake_kube import FakeKube
from pdserve_dev.testing.fake_prometheus import fake_prometheus
from pdserve_dev.testing.metrics import samples
from pdserve_dev.testing.owners import controlled, replica_set_pod
from pdserve_operator.autoscaler.collector import ENGINE_QUERIES, ROUTER_QUERIES, Collector, Target, connect
from pdserve_operator.autoscaler.core import AutoscalerConfig, config_from_spec
from pdserve_operator.autoscaler.loop import (
    CHECK_S,
    MAX_BACKOFF,
    Autoscalers,
    LoopSettings,
    ServiceLoop,
    ServiceView,
    read_service,
    wants_loop,
)
from pdserve_operator.autoscaler.metrics import AutoscalerMetrics
from pdserve_operator.autoscaler.report import ScalingBoard
from pdserve_operator.autoscaler.signals import ROLES, PodState, PoolSignals, RouterSignals, ServiceSignals
from pdserve_operator.observed import Snapshot
from pdserve_operator.reconcile import reconcile
from pdserve_operator.store import Store
from pdserve_operator.view import SpecViews

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "pdservice.yaml"
NAMESPACE, NAME = "default", "llama-8b"
KEY = (NAMESPACE, NAME)


def document(prefill: dict[str, Any] | None = None, decode: dict[str, Any] | None = None) -> dict[str, Any]:
    """examples/pdservice.yaml with prefill (1-4 replicas) scaled by pdserve, decode left alone unless given."""
    doc: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["prefill"]["replicas"] = 1
    doc["spec"]["prefill"]["autoscaling"] = prefill or {"enabled": True, "minReplicas": 1, "maxReplicas": 4}
    doc["spec"]["decode"]["autoscaling"] = decode or {"enabled": False}
    return doc


@dataclass
class Scripted:
    """A fake signal source (see the module docstring): `load` is prefill's uncached prompt tokens/s, `ttft_s` the
    routers' TTFT, `broken` makes every query fail (Prometheus down), `crash` makes collect raise (a bug)."""

    load: float = 1000.0
    ttft_s: float = 0.2
    broken: bool = False
    crash: bool = False
    seen: list[tuple[Target, list[PodState], list[str]]] = field(default_factory=list)
    closed: int = 0
    #: The `now` of every collect (the tick's time on the loops' wall clock).
    nows: list[float] = field(default_factory=list)
    #: Called on every collect: a test moves the world's monotonic clock with it (a tick that takes time).
    on_collect: Callable[[], None] = lambda: None

    async def collect(
        self, target: Target, pods: Sequence[PodState], now: float, routers: Sequence[str] = ()
    ) -> ServiceSignals:
        self.seen.append((target, list(pods), list(routers)))
        self.nows.append(now)
        self.on_collect()
        if self.crash:
            raise RuntimeError("collector bug")
        if self.broken:
            pools = {role: PoolSignals(role, target.desired[role]) for role in ROLES}
            return ServiceSignals(
                now, target.window_s, target.percentile, pools["prefill"], pools["decode"],
                errors=("prefill uncached_tokens: ConnectionError: refused",), failed_queries=("uncached_tokens",),
            )  # fmt: skip
        prefill = PoolSignals(
            "prefill",
            target.desired["prefill"],
            ready=target.desired["prefill"],
            request_rate=self.load / 2000,
            prompt_tokens_rate=self.load,
            uncached_tokens_rate=self.load,
            prompt_tokens_quantile=2000.0,
            waiting=0.0,
            engine_ttft_s=self.ttft_s * 0.8,
            freshness_s=1.0,
            completeness=1.0,
        )
        decode = PoolSignals("decode", target.desired["decode"], ready=target.desired["decode"])
        router = RouterSignals(ttft_s=self.ttft_s, ttft_pd_s=self.ttft_s, itl_s=0.02, freshness_s=1.0)
        return ServiceSignals(now, target.window_s, target.percentile, prefill, decode, router)

    async def close(self) -> None:
        self.closed += 1


def loop_settings(
    interval_s: float = OperatorSettings.autoscaler_interval_seconds, check_s: float = CHECK_S
) -> LoopSettings:
    """The loops' timing as the operator sets it by default, with a shorter tick or check where a test asks."""
    return LoopSettings(
        interval_s=interval_s,
        window_s=OperatorSettings.autoscaler_window_seconds,
        check_s=check_s,
        max_backoff=MAX_BACKOFF,
    )


class World:
    """FakeKube, the informer cache, the board and an `Autoscalers` over them, with a clock that ticks 15 s a call."""

    def __init__(self, doc: dict[str, Any] | None = None, settings: LoopSettings | None = None) -> None:
        self.kube = FakeKube()
        self.store = Store()
        self.board = ScalingBoard(configured=True)
        self.source = Scripted()
        self.registry = CollectorRegistry()
        self.queued: list[tuple[str, str]] = []
        self.leader = True
        self._clock = itertools.count(1_800_000_000, 15)
        #: The loops' monotonic clock (their cadence): still unless a test moves it.
        self.mono = 0.0
        self.delays: list[float] = []
        self.budget = 1_000_000
        self.views = SpecViews(DEFAULT_POLICY)
        self.scalers = Autoscalers(
            self.store,
            self.kube,
            self.board,
            lambda: self.source,
            views=self.views,
            metrics=AutoscalerMetrics(self.registry),
            settings=settings or loop_settings(),
            is_leader=lambda: self.leader,
            enqueue=self.queued.append,
            clock=lambda: float(next(self._clock)),
            sleep=self.sleep,
            monotonic=lambda: self.mono,
        )
        self.put_spec(doc or document())
        self.reconcile()
        for obj in self.kube.finish_rollouts():
            self.store.put(obj)
        self.add_pods()
        self.reconcile()

    async def sleep(self, delay: float) -> None:
        """The loops' sleep: records how long a loop would wait, then only yields (time is the clock's); once
        `budget` sleeps are used up it waits until cancelled (`run_ticks` runs a loop for so many ticks)."""
        self.delays.append(delay)
        self.budget -= 1
        if self.budget <= 0:
            await asyncio.Event().wait()
        await asyncio.sleep(0)

    def put_spec(self, doc: dict[str, Any]) -> None:
        self.store.put_owner(self.kube.add_owner(doc))

    def reconcile(self) -> None:
        reconcile(
            NAMESPACE,
            NAME,
            self.store,
            self.kube,
            lambda: "2026-01-01T00:00:00Z",
            views=self.views,
            crash_window=OperatorSettings.crash_recovery_seconds,
            scaling=self.board,
        )

    def snapshot(self) -> Snapshot:
        return self.store.snapshot(NAMESPACE, NAME)

    def sts(self, role: str) -> dict[str, Any]:
        return self.kube.objects[("StatefulSet", NAMESPACE, f"{NAME}-{role}")]

    def add_pods(self) -> None:
        """Ready engine pods for each StatefulSet's replicas and a router pod, as the cache would hold them (their
        controllers' owner references included)."""
        for role in ("prefill", "decode"):
            for index in range(int(self.sts(role)["spec"]["replicas"])):
                self.store.put(controlled(pod(f"{NAME}-{role}-{index}", role), self.sts(role)))
        self.store.put(replica_set_pod(pod(f"{NAME}-router-abc", "router"), f"{NAME}-router"))

    def loop(self) -> ServiceLoop:
        return ServiceLoop(KEY, self.scalers)

    def status(self) -> dict[str, Any]:
        return cast(dict[str, Any], self.kube.owner(NAMESPACE, NAME).get("status") or {})

    def condition(self, type_: str) -> dict[str, Any]:
        found = [c for c in self.status().get("conditions", []) if c["type"] == type_]
        assert len(found) == 1, self.status().get("conditions")
        return dict(found[0])

    def metric(self, name: str, **labels: str) -> float | None:
        from prometheus_client import generate_latest

        key = name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
        return samples(generate_latest(self.registry).decode()).get(key)


def pod(name: str, role: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "resourceVersion": "1",
            "labels": {"app.kubernetes.io/instance": NAME, "pdserve.io/role": role},
        },
        "status": {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2020-01-01T00:00:00Z"}],
        },
    }


async def tick(world: World, loop: ServiceLoop | None = None) -> tuple[ServiceLoop, bool]:
    loop = loop or world.loop()
    return loop, await loop.tick()


# ------------------------------------------------------------------------------------------- which services


def test_wants_a_loop_only_for_a_pool_scaled_by_pdserve() -> None:
    assert wants_loop(document())
    assert wants_loop(document(prefill={"enabled": False}, decode={"enabled": True, "mode": "pdserve"}))
    assert not wants_loop(document(prefill={"enabled": True, "mode": "external"}))
    assert not wants_loop(document(prefill={"enabled": False}))
    deleting = document()
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert not wants_loop(deleting)
    assert not wants_loop(None)


async def test_loops_run_on_the_leader_for_scaled_services_and_stop_when_that_ends() -> None:
    world = World()
    other = document(prefill={"enabled": True, "mode": "external"})
    other["metadata"]["name"] = "external-only"
    world.put_spec(other)
    world.scalers.sync()
    assert set(world.scalers.loops) == {KEY}
    await asyncio.sleep(0)  # the loop's first tick
    await wait_until(lambda: world.board.get(KEY) is not None)
    assert world.metric("pdserve_autoscaler_desired_replicas", namespace=NAMESPACE, pdservice=NAME, pool="prefill")
    # The error counters exist at 0 from the start, so rate() sees the first failure.
    service = {"namespace": NAMESPACE, "pdservice": NAME}
    for stage in ("collect", "decide", "scale"):
        assert world.metric("pdserve_autoscaler_errors_total", **service, stage=stage) == 0
    assert world.metric("pdserve_autoscaler_query_errors_total", **service, query="router_ttft_pd") == 0
    assert world.metric("pdserve_autoscaler_last_tick_timestamp_seconds", **service) == world.source.nows[0]
    assert (
        world.metric("pdserve_autoscaler_errors_total", namespace=NAMESPACE, pdservice="external-only", stage="scale")
        is None
    )

    # Leadership lost: the loop stops, its series and its report go (only the leader exports them).
    world.leader = False
    world.scalers.sync()
    assert world.scalers.loops == {}
    assert world.board.get(KEY) is None
    assert (
        world.metric("pdserve_autoscaler_desired_replicas", namespace=NAMESPACE, pdservice=NAME, pool="prefill") is None
    )
    assert world.metric("pdserve_autoscaler_errors_total", **service, stage="scale") is None
    assert world.metric("pdserve_autoscaler_query_errors_total", **service, query="router_ttft_pd") is None
    assert world.metric("pdserve_autoscaler_last_tick_timestamp_seconds", **service) is None

    # Leader again: the loop comes back; the PDService handed to an external scaler stops it.
    world.leader = True
    world.scalers.sync()
    assert set(world.scalers.loops) == {KEY}
    world.put_spec(document(prefill={"enabled": True, "mode": "external"}))
    world.scalers.sync()
    assert world.scalers.loops == {}

    # Deleted: no loop.
    world.put_spec(document())
    world.scalers.sync()
    assert set(world.scalers.loops) == {KEY}
    world.store.delete_owner(NAMESPACE, NAME)
    world.scalers.sync()
    assert world.scalers.loops == {}
    await world.scalers.stop_all()


async def test_run_stops_every_loop_when_the_operator_stops() -> None:
    world = World(settings=loop_settings(interval_s=0.01, check_s=0.01))
    stop = asyncio.Event()
    runner = asyncio.create_task(world.scalers.run(stop))
    await wait_until(lambda: len(world.source.seen) >= 3)
    stop.set()
    await asyncio.wait_for(runner, 5)
    assert world.scalers.loops == {}


# ------------------------------------------------------------------------------------------------ one tick


async def test_a_breach_scales_prefill_through_its_statefulset_scale_and_says_why() -> None:
    world = World()
    world.source.load, world.source.ttft_s = 100_000.0, 1.2
    _, healthy = await tick(world)
    assert healthy
    target, pods, routers = world.source.seen[-1]
    # The loop read the cache: each StatefulSet's replicas, the engine pods, the live router pods.
    assert target.desired == {"prefill": 1, "decode": 4}
    assert sorted(p.name for p in pods) == [f"{NAME}-decode-{i}" for i in range(4)] + [f"{NAME}-prefill-0"]
    assert routers == [f"{NAME}-router-abc"]

    [write] = [c for c in world.kube.calls if c.verb == "scale"]
    assert (write.kind, write.name, write.outcome) == ("StatefulSet", f"{NAME}-prefill", "ok")
    desired = world.sts("prefill")["spec"]["replicas"]
    assert desired > 1
    [event] = [e for e in world.kube.events if e["reason"] == "Scaled"]
    assert event["type"] == "Normal"
    assert event["message"].startswith(f"Scaled prefill 1 -> {desired}: TTFT p90 1.2 s > 800 ms target")
    # The cache adopted the new size at the version the write produced, before any watch event.
    cached = world.store.snapshot(NAMESPACE, NAME).child("StatefulSet", NAMESPACE, f"{NAME}-prefill")
    assert cached is not None and cached["spec"]["replicas"] == desired
    assert cached["metadata"]["resourceVersion"] == world.sts("prefill")["metadata"]["resourceVersion"]
    # Decode is not scaled by pdserve: never written.
    assert world.sts("decode")["spec"]["replicas"] == 4

    labels = {"namespace": NAMESPACE, "pdservice": NAME}
    assert world.metric("pdserve_autoscaler_desired_replicas", **labels, pool="prefill") == desired
    assert world.metric("pdserve_autoscaler_current_replicas", **labels, pool="prefill") == 1
    assert world.metric("pdserve_autoscaler_ready_replicas", **labels, pool="prefill") == 1
    assert world.metric("pdserve_autoscaler_decisions_total", **labels, pool="prefill", reason="ScaledUp") == 1
    assert world.metric("pdserve_autoscaler_decisions_total", **labels, pool="decode", reason="AutoscalingDisabled")
    assert world.metric("pdserve_autoscaler_observed_latency_seconds", **labels, kind="ttft") == 1.2
    assert world.metric("pdserve_autoscaler_last_tick_timestamp_seconds", **labels) == world.source.nows[-1]
    assert (world.metric("pdserve_autoscaler_capacity_per_replica", **labels, pool="prefill") or 0) > 0
    assert (world.metric("pdserve_autoscaler_demand", **labels, pool="prefill") or 0) >= 100_000
    # The report changed: the PDService is queued, and its reconcile writes the report into status.
    assert world.queued == [KEY]
    world.reconcile()
    scaling = world.status()["prefill"]["autoscaling"]
    assert scaling["mode"] == "pdserve" and scaling["reason"] == "ScaledUp"
    assert (scaling["currentReplicas"], scaling["desiredReplicas"]) == (1, desired)
    assert (scaling["metric"], scaling["percentile"]) == ("TTFT", 90)
    assert (scaling["observedMilliseconds"], scaling["targetMilliseconds"]) == (1200.0, 800.0)
    assert scaling["capacityPerReplica"] > 0 and scaling["demand"] >= 100_000
    assert scaling["loadUnit"] == "uncached prompt tokens/s" and scaling["capacityBasis"] in ("prior", "learned")
    assert scaling["lastScaleTime"] == "2027-01-15T08:00:00Z"
    assert "autoscaling" not in world.status()["decode"]  # disabled: nothing to say
    assert world.condition("ScalingActive")["status"] == "True"
    assert world.condition("AbleToScale")["status"] == "True"
    assert world.condition("ScalingLimited")["status"] == "False"
    # The scaling conditions follow the reconcile's own six, which keep their meaning.
    assert [c["type"] for c in world.status()["conditions"]] == [
        "Available",
        "Progressing",
        "Degraded",
        "Ready",
        "Reconciling",
        "Stalled",
        "ScalingActive",
        "AbleToScale",
        "ScalingLimited",
    ]

    # Nothing changed: the next pass writes nothing.
    mark = world.kube.mark()
    world.reconcile()
    assert [c for c in world.kube.calls_since(mark) if c.verb == "status"] == []


async def test_the_threshold_it_chooses_reaches_the_routers_status_events_and_metrics() -> None:
    doc = document()
    doc["spec"]["router"]["routing"]["disaggregationThreshold"] = 256
    doc["spec"]["autoscaling"] = {"disaggregationThreshold": {"minTokens": 128, "maxTokens": 4096}}
    world = World(doc)
    control = ("ConfigMap", NAMESPACE, f"{NAME}-router-control")

    def published() -> RouterControl:
        return RouterControl.model_validate_json(world.kube.objects[control]["data"]["control.json"])

    # Before any tick: the configured value, published and in status.
    assert published().disaggregation_threshold == 256
    assert world.status()["disaggregationThreshold"]["reason"] == "Configured"
    # Prefill's TTFT breaks its budget and decode's ITL (20 ms of 40) has room for prompts up to 511 tokens
    # (256 more tokens in a step: 8 ms).
    world.source.load, world.source.ttft_s = 100_000.0, 1.2
    loop, _ = await tick(world)
    [event] = [e for e in world.kube.events if e["reason"] == "DisaggregationThreshold"]
    assert event["message"].startswith("Disaggregation threshold 256 -> 512 tokens: prefill engine TTFT 960 ms >")
    labels = {"namespace": NAMESPACE, "pdservice": NAME}
    assert world.metric("pdserve_autoscaler_disaggregation_threshold_tokens", **labels) == 512
    assert world.metric("pdserve_autoscaler_threshold_decisions_total", **labels, reason="PrefillShort") == 1
    world.reconcile()
    assert published().disaggregation_threshold == 512
    assert published().reason == event["message"].removeprefix("Disaggregation threshold 256 -> 512 tokens: ")
    status = world.status()["disaggregationThreshold"]
    assert (status["tokens"], status["minTokens"], status["maxTokens"], status["reason"]) == (
        512, 128, 4096, "PrefillShort",
    )  # fmt: skip
    assert status["lastChangeTime"] == event["time"]
    # 512 -> 1024 would add 16 ms to decode's 20 ms steps: held, said so; the ConfigMap is not rewritten.
    mark = world.kube.mark()
    await tick(world, loop)
    world.reconcile()
    assert world.status()["disaggregationThreshold"]["reason"] == "NoDecodeHeadroom"
    assert not [c for c in world.kube.calls_since(mark) if c.verb == "apply" and c.kind == "ConfigMap"]
    # A new leader starts from what status says, not from the configured value; prefill calm, it steps back.
    world.source.load, world.source.ttft_s = 1000.0, 0.2
    await tick(world)
    assert world.metric("pdserve_autoscaler_disaggregation_threshold_tokens", **labels) == 256
    [_, back] = [e for e in world.kube.events if e["reason"] == "DisaggregationThreshold"]
    assert back["message"].startswith("Disaggregation threshold 512 -> 256 tokens: prefill has capacity again")
    # Bounds removed from the spec: the ConfigMap publishes no threshold (routers go back to their configured
    # value), only the SLO's TTFT target; the status field goes.
    world.put_spec(document())
    world.reconcile()
    ttft = document()["spec"]["slo"]["ttftMilliseconds"] / 1000
    assert (published().disaggregation_threshold, published().ttft_target_seconds) == (None, ttft)
    assert "disaggregationThreshold" not in world.status()


async def test_the_operator_apply_keeps_what_the_autoscaler_wrote() -> None:
    world = World()
    world.source.load, world.source.ttft_s = 100_000.0, 1.2
    await tick(world)
    desired = world.sts("prefill")["spec"]["replicas"]
    # A spec change re-applies the StatefulSet: with the autoscaler's replicas, not the spec's.
    doc = document()
    doc["spec"]["prefill"]["env"] = [{"name": "CHANGED", "value": "1"}]
    world.put_spec(doc)
    mark = world.kube.mark()
    world.reconcile()
    assert any(c.verb == "apply" and c.name == f"{NAME}-prefill" for c in world.kube.calls_since(mark))
    assert world.sts("prefill")["spec"]["replicas"] == desired


def test_a_stale_cache_cannot_undo_a_scale() -> None:
    world = World(document(prefill={"enabled": True, "minReplicas": 1, "maxReplicas": 4}))
    # A scaler writes /scale; the watch event has not reached the cache yet when the spec changes.
    world.kube.set_replicas("StatefulSet", NAMESPACE, f"{NAME}-prefill", 3)
    doc = document()
    doc["spec"]["prefill"]["env"] = [{"name": "CHANGED", "value": "1"}]
    world.put_spec(doc)
    with pytest.raises(Exception, match="has been modified"):
        world.reconcile()
    assert world.sts("prefill")["spec"]["replicas"] == 3
    # The watch event arrives; the retried pass applies the change and keeps 3.
    world.store.put(copy.deepcopy(world.sts("prefill")))
    world.reconcile()
    assert world.sts("prefill")["spec"]["replicas"] == 3
    env = world.sts("prefill")["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "CHANGED", "value": "1"} in env


def test_an_external_pool_keeps_what_its_scaler_set_even_outside_the_bounds() -> None:
    world = World(document(decode={"enabled": True, "mode": "external", "minReplicas": 2, "maxReplicas": 6}))
    # HPA-like: sets decode to 9 through /scale (beyond the spec's maxReplicas: the HPA's bounds are its own).
    world.store.put(world.kube.set_replicas("StatefulSet", NAMESPACE, f"{NAME}-decode", 9))
    doc = document(decode={"enabled": True, "mode": "external", "minReplicas": 2, "maxReplicas": 6})
    doc["spec"]["decode"]["env"] = [{"name": "CHANGED", "value": "1"}]
    world.put_spec(doc)
    world.reconcile()
    assert world.sts("decode")["spec"]["replicas"] == 9
    scaling = world.status()["decode"]["autoscaling"]
    assert (scaling["mode"], scaling["reason"], scaling["currentReplicas"]) == ("external", "ExternallyScaled", 9)


async def test_an_external_pool_is_never_scaled_by_the_loop() -> None:
    world = World(document(decode={"enabled": True, "mode": "external", "minReplicas": 1, "maxReplicas": 6}))
    world.source.load, world.source.ttft_s = 100_000.0, 1.2
    await tick(world)
    assert [c.name for c in world.kube.calls if c.verb == "scale"] == [f"{NAME}-prefill"]
    report = world.board.get(KEY)
    assert report is not None and report.pools["decode"].reason == "ExternallyScaled"


# ------------------------------------------------------------------------------------------ a tick's steps


def service_view(world: World) -> ServiceView:
    view = read_service(KEY, world.views.checked(world.store.owner(*KEY) or {}).require()[1], world.snapshot())
    assert view is not None
    return view


def configured(world: World) -> AutoscalerConfig:
    settings = world.scalers.settings
    return config_from_spec(service_view(world).spec, interval_s=settings.interval_s, window_s=settings.window)


def test_read_service_reads_the_pools_and_the_live_pods_from_the_cache() -> None:
    world = World()
    terminating = replica_set_pod(pod(f"{NAME}-router-old", "router"), f"{NAME}-router")
    terminating["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    world.store.put(terminating)
    view = service_view(world)
    assert view.desired == {"prefill": 1, "decode": 4}
    assert {role: sts["metadata"]["name"] for role, sts in view.statefulsets.items()} == {
        "prefill": f"{NAME}-prefill",
        "decode": f"{NAME}-decode",
    }
    assert sorted(p["metadata"]["name"] for p in view.engine_pods) == sorted(
        [f"{NAME}-prefill-0", *(f"{NAME}-decode-{i}" for i in range(4))]
    )
    assert view.routers == [f"{NAME}-router-abc"]  # the terminating one serves no new request
    # Pods that carry a pool's labels but that its StatefulSet does not control (an `edit` user's own pod, labelled
    # and named like a pool member, or claiming the StatefulSet under a name it never gives its pods) are not
    # the pool's: not counted, not scraped.
    labels = {"app.kubernetes.io/managed-by": "pdserve-operator"}
    forged = pod(f"{NAME}-prefill-1", "prefill")
    forged["metadata"]["labels"].update(labels)
    world.store.put(forged)
    world.store.put(controlled(pod(f"{NAME}-prefill-evil", "prefill"), world.sts("prefill")))
    world.store.put(pod(f"{NAME}-router-forged", "router"))
    view = service_view(world)
    assert sorted(p["metadata"]["name"] for p in view.engine_pods if "prefill" in p["metadata"]["name"]) == [
        f"{NAME}-prefill-0"
    ]
    assert view.routers == [f"{NAME}-router-abc"]
    # A pool without its StatefulSet yet: nothing to read (the reconcile creates it first).
    world.store.delete(world.sts("decode"))
    spec = world.views.checked(world.store.owner(*KEY) or {}).require()[1]
    assert read_service(KEY, spec, world.snapshot()) is None


async def test_collect_asks_for_the_window_and_warm_up_the_service_is_configured_with() -> None:
    world = World(settings=LoopSettings(interval_s=20.0, window_s=45.0, check_s=CHECK_S, max_backoff=MAX_BACKOFF))
    loop, config = world.loop(), configured(world)
    signals = await loop.collect(service_view(world), config, 1_800_000_000.0)
    target, pods, routers = world.source.seen[-1]
    assert (target.window_s, target.warmup_s, target.percentile) == (45.0, 60.0, 90)
    assert target.desired == {"prefill": 1, "decode": 4} and signals.window_s == 45.0
    assert config.model.interval_s == 20.0
    assert {p.role for p in pods} == {"prefill", "decode"} and routers == [f"{NAME}-router-abc"]


async def test_decide_keeps_what_the_model_learned_when_the_spec_changes() -> None:
    world = World()
    world.source.load, world.source.ttft_s = 100_000.0, 1.2
    loop, config = world.loop(), configured(world)
    signals = await loop.collect(service_view(world), config, 1_800_000_000.0)
    first = loop.decide(config, signals)
    autoscaler = loop.autoscaler
    assert first.prefill.desired > 1 and autoscaler is not None
    narrower = replace(config, policy=replace(config.policy, prefill=replace(config.policy.prefill, max_replicas=2)))
    again = loop.decide(narrower, signals)
    assert loop.autoscaler is autoscaler and autoscaler.config is narrower
    assert again.prefill.desired == 2


async def test_actuate_writes_scale_adopts_it_and_explain_remembers_when() -> None:
    world = World()
    world.source.load, world.source.ttft_s = 100_000.0, 1.2
    loop, config, view = world.loop(), configured(world), service_view(world)
    signals = await loop.collect(view, config, 1_800_000_000.0)
    decision = loop.decide(config, signals)
    body = world.store.owner(*KEY)
    assert body is not None
    assert await loop.actuate(body, view, decision, 1_800_000_000.0) == {}
    assert [(c.verb, c.name) for c in world.kube.calls if c.verb == "scale"] == [("scale", f"{NAME}-prefill")]
    cached = world.snapshot().child("StatefulSet", NAMESPACE, f"{NAME}-prefill")
    assert cached is not None and cached["spec"]["replicas"] == decision.prefill.desired
    assert [e["reason"] for e in world.kube.events if e["reason"] == "Scaled"] == ["Scaled"]
    report = loop.explain(decision, signals, config, {}, 1_800_000_000.0)
    assert report.pools["prefill"].last_scale_time == "2027-01-15T08:00:00Z"
    assert loop.last_scale_time == {"prefill": "2027-01-15T08:00:00Z", "decode": None}
    # A refused write is not a scale: the time stays what it was.
    later = loop.explain(decision, signals, config, {"prefill": "refused"}, 1_800_000_100.0)
    assert later.pools["prefill"].last_scale_time == "2027-01-15T08:00:00Z"


# --------------------------------------------------------------------------------------------------- failures


async def test_metrics_unavailable_holds_and_says_why() -> None:
    world = World()
    world.source.broken = True
    loop, healthy = await tick(world)
    assert not healthy  # counted as a failure: the next tick backs off
    assert [c for c in world.kube.calls if c.verb == "scale"] == []
    world.reconcile()
    active = world.condition("ScalingActive")
    assert (active["status"], active["reason"]) == ("False", "MetricsUnavailable")
    assert "ConnectionError" in active["message"]
    assert world.status()["prefill"]["autoscaling"]["reason"] == "MetricsUnavailable"
    [warning] = [e for e in world.kube.events if e["reason"] == "MetricsUnavailable"]
    assert warning["type"] == "Warning"
    labels = {"namespace": NAMESPACE, "pdservice": NAME}
    assert world.metric("pdserve_autoscaler_query_errors_total", **labels, query="uncached_tokens") == 1
    # Back: active again, and a Normal event says so.
    world.source.broken = False
    _, healthy = await tick(world, loop)
    assert healthy
    world.reconcile()
    assert world.condition("ScalingActive")["status"] == "True"
    assert [e["type"] for e in world.kube.events if e["reason"] == "ScalingActive"] == ["Normal"]


async def test_a_refused_scale_is_reported_and_retried_with_backoff() -> None:
    world = World(settings=loop_settings(interval_s=0.01))
    world.source.load, world.source.ttft_s = 100_000.0, 1.2
    world.kube.fail("scale", 422, "admission webhook denied the request", times=3)
    loop = world.loop()
    _, healthy = await tick(world, loop)
    assert not healthy
    [warning] = [e for e in world.kube.events if e["reason"] == "FailedUpdateScale"]
    assert warning["type"] == "Warning" and "admission webhook denied" in warning["message"]
    report = world.board.get(KEY)
    assert report is not None
    able = next(c for c in report.conditions if c.type == "AbleToScale")
    assert (able.status, able.reason) == ("False", "FailedUpdateScale")
    assert report.pools["prefill"].reason == "FailedUpdateScale"
    assert report.pools["prefill"].last_scale_time is None
    labels = {"namespace": NAMESPACE, "pdservice": NAME}
    assert world.metric("pdserve_autoscaler_errors_total", **labels, stage="scale") == 1
    # The loop backs off (2, then 4 intervals), then the write goes through and the backoff resets.
    delays = await run_ticks(world, loop, 3)
    assert delays == [pytest.approx(0.02), pytest.approx(0.04), pytest.approx(0.01)]
    assert world.sts("prefill")["spec"]["replicas"] > 1


async def test_a_crashing_collector_never_stops_the_loop() -> None:
    world = World(settings=loop_settings(interval_s=0.01))
    world.source.crash = True
    loop = world.loop()
    delays = await run_ticks(world, loop, 4)
    assert delays == [pytest.approx(d) for d in (0.02, 0.04, 0.04, 0.04)]  # backoff capped at 4 intervals
    labels = {"namespace": NAMESPACE, "pdservice": NAME}
    assert world.metric("pdserve_autoscaler_errors_total", **labels, stage="collect") == 4
    world.source.crash = False
    assert await run_ticks(world, loop, 1) == [pytest.approx(0.01)]


async def test_ticks_start_on_a_fixed_cadence_whatever_a_tick_takes() -> None:
    # The wait after a tick is the interval less the tick's own time (start to start); a tick longer than the
    # interval is followed at once (no negative wait, no catch-up); a failed tick's backoff counts the same way.
    world = World(settings=loop_settings(interval_s=2.0))
    busy = iter([0.3, 0.5, 2.5, 0.0])

    def take_time() -> None:
        world.mono += next(busy)

    world.source.on_collect = take_time
    loop = world.loop()
    assert await run_ticks(world, loop, 4) == [pytest.approx(d) for d in (1.7, 1.5, 0.0, 2.0)]
    world.source.crash = True
    world.source.on_collect = lambda: setattr(world, "mono", world.mono + 1.0)
    assert await run_ticks(world, loop, 1) == [pytest.approx(3.0)]  # backoff: 2 intervals, start to start


async def test_leadership_lost_mid_tick_ends_the_loop() -> None:
    world = World(settings=loop_settings(interval_s=0.01))
    world.source.load, world.source.ttft_s = 100_000.0, 1.2
    world.kube.leader = False
    await asyncio.wait_for(world.loop().run(), 5)  # returns instead of retrying
    assert [c.outcome for c in world.kube.calls if c.verb == "scale"] == ["not-leader"]


async def test_no_slo_target_holds_and_says_how_to_fix_it() -> None:
    doc = document()
    del doc["spec"]["slo"]
    world = World(doc)
    _, healthy = await tick(world)
    assert healthy and world.source.seen == []  # nothing to decide: not even a query
    world.reconcile()
    active = world.condition("ScalingActive")
    assert (active["status"], active["reason"]) == ("False", "NoSloTarget")
    assert "spec.slo.ttftMilliseconds" in active["message"]


def test_without_prometheus_pools_hold_and_status_says_so() -> None:
    world = World()
    world.board.configured = False
    world.reconcile()
    active = world.condition("ScalingActive")
    assert (active["status"], active["reason"]) == ("False", "PrometheusNotConfigured")
    assert "--prometheus-url" in active["message"]
    scaling = world.status()["prefill"]["autoscaling"]
    assert (scaling["reason"], scaling["currentReplicas"], scaling["desiredReplicas"]) == (
        "PrometheusNotConfigured",
        1,
        1,
    )
    [warning] = [e for e in world.kube.events if e["reason"] == "PrometheusNotConfigured"]
    assert warning["type"] == "Warning"


def test_turning_autoscaling_off_removes_its_status_and_conditions() -> None:
    world = World()
    world.board.configured = False
    world.reconcile()
    assert "autoscaling" in world.status()["prefill"]
    world.put_spec(document(prefill={"enabled": False}))
    world.reconcile()
    assert "autoscaling" not in world.status()["prefill"]
    types = {c["type"] for c in world.status()["conditions"]}
    assert not types & {"ScalingActive", "AbleToScale", "ScalingLimited"}


# ------------------------------------------------------------------------------------------------ isolation


@pytest.mark.timeout(120)
async def test_a_pdservice_whose_prometheus_trickles_delays_no_other_loop() -> None:
    """Four PDServices' queries hang (their Prometheus trickles its answers: a stand-in on a real socket,
    `fake_prometheus`, since a real one will not hang on demand) with a deadline far off; a fifth's, to a prompt
    Prometheus, is answered all the same: the loops share no thread pool and no connection (the operator's
    autoscaler pool has 4 threads, the runner's AUTOSCALER_THREADS)."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        world = World()
        world.scalers.executor = pool
        async with fake_prometheus(trickle="body") as slow, fake_prometheus() as prompt:
            collectors = [Collector(connect(slow.url), deadline_s=600.0) for _ in range(4)]
            collectors.append(Collector(connect(prompt.url), deadline_s=600.0))
            made = iter(collectors)
            world.scalers.sources = lambda: next(made)
            loops = [world.loop() for _ in collectors]
            view, config = service_view(world), configured(world)
            stuck = [asyncio.create_task(loop.collect(view, config, 1_800_000_000.0)) for loop in loops[:4]]
            try:
                await wait_until(lambda: len(slow.queries) == 4, within=30)  # all four hang in their first query
                signals = await asyncio.wait_for(loops[4].collect(view, config, 1_800_000_000.0), 30)
                assert not any(task.done() for task in stuck)
            finally:
                for task in stuck:
                    task.cancel()
                await asyncio.gather(*stuck, return_exceptions=True)
                for collector in collectors:
                    await collector.close()
    assert len(prompt.queries) == len(ENGINE_QUERIES) * 2 + len(ROUTER_QUERIES)
    assert signals.errors == ()


# -------------------------------------------------------------------------------------------------- helpers


async def wait_until(predicate: Callable[[], object], within: float = 5.0) -> None:
    from pdserve_dev.testing.wait import wait_for_async

    async def check() -> bool:
        return bool(predicate())

    await wait_for_async(check, within=within, interval=0.005)


async def run_ticks(world: World, loop: ServiceLoop, count: int) -> list[float]:
    """Run `loop` for `count` more ticks; returns the delay it waited after each (its backoff), read from the
    `sleep` the loops are given (the world's, which records the delay and yields without waiting)."""
    first = len(world.delays)
    world.budget = count
    task = asyncio.create_task(loop.run())
    try:
        await wait_until(lambda: len(world.delays) >= first + count)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return world.delays[first : first + count]
