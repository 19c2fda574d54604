"""The autoscaler in the operator (IO): one control loop per PDService that has a pool scaled by pdserve.

`Autoscalers` keeps the set of loops equal to what it should be, re-checked every `check_s` (1 s): a loop for
every PDService in the informer cache with a pool whose autoscaling is enabled in mode pdserve, while this
replica is the leader and has a Prometheus (`--prometheus-url`). A PDService deleted, its autoscaling turned off
or handed to an external scaler, leadership lost: its loop is cancelled, its metrics removed, its report dropped.

A `ServiceLoop` ticks every `interval_s` on its own task, never blocking the event loop or the reconciles. Ticks
start on a fixed cadence (start to start, on the monotonic clock): the time a tick takes (its queries, its writes)
does not stretch the period, so the model's interval is the one the user set, and a tick that took longer than the
interval is followed at once by the next, never by a burst of catch-up ticks. A tick
reads its service from the cache, then runs collect -> decide -> actuate -> report, each a method of its own:

0. read (pure, `read_service`): the spec's validation result from the operator's shared `SpecViews` (the one the
   reconcile reads: validated once per stored version; an invalid spec holds, the reconcile reports it), the
   pools' StatefulSets (spec.replicas = what each pool is asked for now), the engine pods and the router pods
   that exist; then `config_from_spec` (the spec may have changed; what the model learned is kept).
1. collect: `pod_states` (ready, starting, pending, terminating, ready for how long) and `collector.collect`, awaited
   on the event loop with its own Prometheus connection and one deadline for all the tick's queries: a slow or
   hung Prometheus answer for one PDService delays no other loop (they share no thread and no connection) and
   no tick past its deadline.
2. decide: `Autoscaler.step` -> `Decision` (pure).
3. actuate: for each pool the decision changes, the actuator writes the StatefulSet's /scale, the cache adopts
   the new replicas at once (so the next reconcile's apply re-asserts the new value, not the old one), and an
   Event says why ("Scaled prefill 1 -> 2: TTFT p90 1.2 s > 800 ms target; ...").
4. report: metrics (`metrics.py`) and the `ScalingReport` on the board; when the report changed, the PDService is
   queued for a reconcile, which writes it into status (the one status writer).

Failures never crash anything and are retried with backoff: a tick that raised (a bug), a /scale the API server
refused, or queries that failed (Prometheus answering with errors, unreachable, past the deadline, a metric
missing) make the next tick come later (interval x 2^failures, at most `max_backoff` x interval); the first clean
tick resets it. Values the bounds rejected (`bounds.py`) hold the pool for that tick but are no query failure.
Metrics missing, stale or partial are the policy's fail-static hold (MetricsUnavailable), reported in status,
conditions and metrics like any decision. Leadership lost mid-tick (a write refused with NotLeaderError) ends the
loop at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Protocol

from pdserve.api.defaults import EffectiveSpec
from pdserve_operator.autoscaler.actuator import Actuator, StatefulSetScaler, pod_states
from pdserve_operator.autoscaler.collector import Target
from pdserve_operator.autoscaler.core import Autoscaler, AutoscalerConfig, NoSloTargetError, config_from_spec
from pdserve_operator.autoscaler.decision import Decision
from pdserve_operator.autoscaler.metrics import AutoscalerMetrics
from pdserve_operator.autoscaler.report import ScalingBoard, ScalingReport, ThresholdReport, from_decision, holding
from pdserve_operator.autoscaler.signals import ROLES, PodState, Role, ServiceSignals
from pdserve_operator.kube import ApiError, KubeIO, NotLeaderError
from pdserve_operator.names import ROLE_LABEL, child_name
from pdserve_operator.observed import OwnerKey, Snapshot
from pdserve_operator.store import Store
from pdserve_operator.view import SpecViews

log = logging.getLogger("pdserve.operator.autoscaler")

NO_SLO_TARGET = "NoSloTarget"
#: How often `Autoscalers` checks the set of loops against the cache and the leadership (seconds).
CHECK_S = 1.0
#: Backoff after failed ticks stops growing at this many intervals.
MAX_BACKOFF = 4.0


class SignalSource(Protocol):
    """What the loop reads signals from: `collector.Collector` (Prometheus), or a fake in unit tests. Each loop
    has its own (`Autoscalers.sources` is called once per loop), closed when the loop ends."""

    async def collect(
        self, target: Target, pods: Sequence[PodState], now: float, routers: Sequence[str] = ()
    ) -> ServiceSignals: ...

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class LoopSettings:
    """Timing of every loop: the operator's flags, and the loop machinery's own pace (`CHECK_S`, `MAX_BACKOFF`)."""

    #: Seconds between ticks (`--autoscaler-interval-seconds`).
    interval_s: float
    #: Rate and quantile window (`--autoscaler-window-seconds`); None: the interval.
    window_s: float | None
    #: How often the set of loops is checked against the cache and the leadership.
    check_s: float
    #: Backoff after failed ticks stops growing at this many intervals.
    max_backoff: float

    @property
    def window(self) -> float:
        return self.window_s if self.window_s is not None else self.interval_s


@dataclass(frozen=True)
class ServiceView:
    """What one tick reads of its PDService from the cache: the effective spec, each pool's StatefulSet and the
    replicas it asks for now, the engine pods and the names of the router pods that exist."""

    namespace: str
    name: str
    spec: EffectiveSpec
    statefulsets: Mapping[Role, dict[str, Any]]
    desired: Mapping[Role, int]
    engine_pods: Sequence[dict[str, Any]]
    routers: Sequence[str]


def read_service(key: OwnerKey, spec: EffectiveSpec, snapshot: Snapshot) -> ServiceView | None:
    """The tick's view of a valid PDService (pure), or None while a pool's StatefulSet does not exist yet (the
    reconcile creates it first)."""
    namespace, name = key
    found = {role: snapshot.child("StatefulSet", namespace, child_name(name, role)) for role in ROLES}
    statefulsets = {role: sts for role, sts in found.items() if sts is not None}
    if len(statefulsets) < len(ROLES):
        return None
    desired: dict[Role, int] = {role: int(sts.get("spec", {}).get("replicas", 0)) for role, sts in statefulsets.items()}
    engine_pods = [p for p in snapshot.pods if (p["metadata"].get("labels") or {}).get(ROLE_LABEL) in ROLES]
    routers = sorted(
        p["metadata"]["name"]
        for p in snapshot.pods
        if (p["metadata"].get("labels") or {}).get(ROLE_LABEL) == "router"
        and not p["metadata"].get("deletionTimestamp")
    )
    return ServiceView(namespace, name, spec, statefulsets, desired, engine_pods, routers)


def wants_loop(body: Mapping[str, Any] | None) -> bool:
    """Whether a PDService (as stored) has a pool scaled by pdserve: autoscaling enabled, mode pdserve (the
    default). Read from the raw object: it runs every second over the whole cache."""
    if not body or (body.get("metadata") or {}).get("deletionTimestamp"):
        return False
    spec = body.get("spec") or {}
    for role in ROLES:
        scaling = (spec.get(role) or {}).get("autoscaling") or {}
        if scaling.get("enabled") is True and scaling.get("mode", "pdserve") in (None, "pdserve"):
            return True
    return False


def _iso(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Autoscalers:
    """Starts, runs and stops the service loops (see the module docstring)."""

    def __init__(
        self,
        store: Store,
        api: KubeIO,
        board: ScalingBoard,
        sources: Callable[[], SignalSource],
        *,
        views: SpecViews,
        metrics: AutoscalerMetrics,
        settings: LoopSettings,
        executor: Executor | None = None,
        is_leader: Callable[[], bool] = lambda: True,
        enqueue: Callable[[OwnerKey], None] = lambda key: None,
        actuator: Actuator | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """`views`: each PDService's validation result, shared with the reconcile (`view.SpecViews`). `clock`: the
        wall clock the reports' times and the signals' windows are read on; `monotonic`: the one the ticks' cadence
        is kept on."""
        self.store, self.api, self.board, self.sources = store, api, board, sources
        self.views, self.metrics, self.executor, self.settings = views, metrics, executor, settings
        self.is_leader, self.enqueue, self.clock, self.sleep = is_leader, enqueue, clock, sleep
        self.monotonic = monotonic
        self.actuator = actuator or StatefulSetScaler(api, executor)
        self.loops: dict[OwnerKey, ServiceLoop] = {}
        self._tasks: dict[OwnerKey, asyncio.Task[None]] = {}

    async def run(self, stop: asyncio.Event) -> None:
        """Keep the loops in step with the cache and the leadership until `stop`; then stop them all."""
        try:
            while not stop.is_set():
                self.sync()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.settings.check_s)
        finally:
            await self.stop_all()

    def wanted(self) -> set[OwnerKey]:
        if not self.is_leader():
            return set()
        return {key for key in self.store.owner_keys() if wants_loop(self.store.owner(*key))}

    def sync(self) -> None:
        """Start the loops that should run, stop those that should not (or that ended: leadership lost)."""
        wanted = self.wanted()
        for key in list(self._tasks):
            if key not in wanted or self._tasks[key].done():
                self._stop(key)
        for key in sorted(wanted - set(self._tasks)):
            loop = ServiceLoop(key, self)
            self.loops[key] = loop
            self.metrics.begin(*key)
            self._tasks[key] = asyncio.create_task(loop.run(), name=f"autoscaler {key[0]}/{key[1]}")
            log.info("Started autoscaler loop pdservice=%s/%s", *key)

    def _stop(self, key: OwnerKey) -> None:
        task = self._tasks.pop(key)
        self.loops.pop(key, None)
        task.cancel()
        self.metrics.forget(*key)
        self.board.drop(key)
        log.info("Stopped autoscaler loop pdservice=%s/%s", *key)

    async def stop_all(self) -> None:
        tasks = list(self._tasks.values())
        for key in list(self._tasks):
            self._stop(key)
        await asyncio.gather(*tasks, return_exceptions=True)


class ServiceLoop:
    """The loop of one PDService: its Autoscaler (model and policy state), its signal source, its backoff."""

    def __init__(self, key: OwnerKey, owner: Autoscalers) -> None:
        self.key, self.owner = key, owner
        self.source = owner.sources()
        self.autoscaler: Autoscaler | None = None
        self.failures = 0
        self.ticks = 0
        body = owner.store.owner(*key) or {}
        status = body.get("status") or {}
        # Carried over from the previous leader's status, so "last scale time" survives a takeover.
        self.last_scale_time: dict[Role, str | None] = {
            role: ((status.get(role) or {}).get("autoscaling") or {}).get("lastScaleTime") for role in ROLES
        }
        # And the threshold the routers use, so a takeover neither jumps back to the configured one nor forgets
        # when and why it last changed.
        threshold = status.get("disaggregationThreshold") or {}
        self.threshold: int | None = threshold.get("tokens") if isinstance(threshold.get("tokens"), int) else None
        self.threshold_changed: tuple[str | None, str] = (
            threshold.get("lastChangeTime"),
            str(threshold.get("message", "")) if threshold.get("lastChangeTime") else "",
        )

    async def run(self) -> None:
        try:
            await self._ticks()
        finally:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.source.close())

    async def _ticks(self) -> None:
        settings = self.owner.settings
        while True:
            started = self.owner.monotonic()
            try:
                healthy = await self.tick()
            except NotLeaderError:
                log.warning("Stopped autoscaler loop: leadership lost pdservice=%s/%s", *self.key)
                return
            except Exception:
                healthy = False
                log.exception("Autoscaler tick failed pdservice=%s/%s", *self.key)
            self.ticks += 1
            self.failures = 0 if healthy else self.failures + 1
            delay = settings.interval_s * min(2.0**self.failures, settings.max_backoff)
            if not healthy:
                log.warning(
                    "Retrying autoscaler tick pdservice=%s/%s failures=%d delay=%.1fs",
                    *self.key,
                    self.failures,
                    delay,
                )
            # Start to start: the tick's own time is taken from the wait (never below zero: no catch-up burst).
            await self.owner.sleep(max(0.0, started + delay - self.owner.monotonic()))

    async def tick(self) -> bool:
        """One tick (module docstring); True when it was clean (no query error, no refused write)."""
        owner = self.owner
        body = owner.store.owner(*self.key)
        if not wants_loop(body):
            return True  # deleted or no longer scaled by pdserve: the next sync stops this loop
        assert body is not None
        checked = owner.views.checked(body)
        if not checked.ok:
            return True  # the reconcile reports InvalidSpec; nothing is scaled until the spec is fixed
        service = read_service(self.key, checked.require()[1], owner.store.snapshot(*self.key))
        if service is None:
            return True  # the reconcile creates the StatefulSets first
        settings = owner.settings
        try:
            config = config_from_spec(service.spec, interval_s=settings.interval_s, window_s=settings.window)
        except NoSloTargetError as exc:
            self.report(holding(service.spec, service.desired, NO_SLO_TARGET, str(exc)))
            return True
        now = owner.clock()
        signals = await self.collect(service, config, now)
        decision = self.decide(config, signals)
        failed = await self.actuate(body, service, decision, now)
        self.report(self.explain(decision, signals, config, failed, now), decision, signals)
        return not signals.failed_queries and not failed

    # ------------------------------------------------------------------------------------------------ steps

    async def collect(self, service: ServiceView, config: AutoscalerConfig, now: float) -> ServiceSignals:
        """Step 1: the service's signals at `now`, read in the autoscaler's thread pool."""
        target = Target(
            service.namespace,
            service.name,
            config.model.slo.percentile,
            window_s=config.window_s,
            warmup_s=config.warmup_s,
            desired=service.desired,
        )
        pods = pod_states(service.engine_pods, datetime.fromtimestamp(now, UTC))
        try:
            return await self.source.collect(target, pods, now, service.routers)
        except Exception:
            self.owner.metrics.error(*self.key, "collect")
            raise

    def decide(self, config: AutoscalerConfig, signals: ServiceSignals) -> Decision:
        """Step 2: model and policy (pure) on this tick's signals, with what they learned before (the spec may
        have changed: the configuration is taken anew, the learned state kept)."""
        if self.autoscaler is None:
            self.autoscaler = Autoscaler(config, threshold=self.threshold)
        else:
            self.autoscaler.reconfigure(config)
        try:
            return self.autoscaler.step(signals)
        except Exception:
            self.owner.metrics.error(*self.key, "decide")
            raise

    async def actuate(
        self, body: dict[str, Any], service: ServiceView, decision: Decision, now: float
    ) -> dict[Role, str]:
        """Step 3: write each changed pool's /scale, adopt the new size in the cache, and say so in an Event.
        Returns the pools whose write the API server refused, with its message."""
        owner, (namespace, name) = self.owner, self.key
        failed: dict[Role, str] = {}
        for pool in decision.actions():
            try:
                scale = await owner.actuator.scale(namespace, name, pool.role, pool.desired)
            except ApiError as exc:
                failed[pool.role] = str(exc)
                owner.metrics.error(namespace, name, "scale")
                log.warning(
                    "Failed to scale pdservice=%s/%s pool=%s from=%d to=%d error=%s",
                    namespace,
                    name,
                    pool.role,
                    pool.current,
                    pool.desired,
                    exc,
                )
                message = f"Failed to scale {pool.role} {pool.current} -> {pool.desired}: {exc}"
                await self._event(body, "Warning", "FailedUpdateScale", message, now)
                continue
            self._adopt(service.statefulsets[pool.role], pool.desired, scale)
            log.info(
                "Scaled pdservice=%s/%s pool=%s from=%d to=%d reason=%s message=%s",
                namespace,
                name,
                pool.role,
                pool.current,
                pool.desired,
                pool.reason,
                pool.message,
            )
            await self._event(body, "Normal", "Scaled", pool.event() or "", now)
        threshold = decision.threshold
        if threshold is not None and threshold.changed:
            # Published by the reconcile the report queues (the router control ConfigMap), within this tick.
            self.threshold_changed = (_iso(now), threshold.message)
            log.info("Changed disaggregation threshold pdservice=%s/%s from=%d to=%d reason=%s message=%s",
                     namespace, name, threshold.current, threshold.desired, threshold.reason,
                     threshold.message)  # fmt: skip
            await self._event(body, "Normal", "DisaggregationThreshold", threshold.event() or "", now)
        return failed

    def explain(
        self,
        decision: Decision,
        signals: ServiceSignals,
        config: AutoscalerConfig,
        failed: Mapping[Role, str],
        now: float,
    ) -> ScalingReport:
        """Step 4, pure part: the tick's report (what status will say), remembering when each pool last scaled."""
        report = from_decision(
            decision, signals, config.model.slo, now=_iso(now), last_scale_time=self.last_scale_time, failed=failed
        )
        for role, line in report.pools.items():
            self.last_scale_time[role] = line.last_scale_time
        threshold = decision.threshold
        if threshold is None:
            return report
        limits = config.threshold_limits
        at, why = self.threshold_changed
        published = ThresholdReport(
            threshold.desired, limits.minimum, limits.maximum, str(threshold.reason), threshold.message, at, why
        )
        return replace(report, threshold=published)

    def report(
        self, report: ScalingReport, decision: Decision | None = None, signals: ServiceSignals | None = None
    ) -> None:
        """Step 4: the tick's metrics, and its report on the board; a changed report queues the PDService for the
        reconcile that writes it into status."""
        if decision is not None and signals is not None:
            self.owner.metrics.record(*self.key, decision, signals)
        if self.owner.board.put(self.key, report):
            self.owner.enqueue(self.key)

    # ---------------------------------------------------------------------------------------------- helpers

    def _adopt(self, sts: Mapping[str, Any], replicas: int, scale: Mapping[str, Any]) -> None:
        """Put the scaled StatefulSet into the cache at the version the /scale write produced, so that a reconcile
        running before its watch event re-applies the new replicas rather than the old ones (the watch event,
        of the same or a later version, replaces this copy)."""
        version = (scale.get("metadata") or {}).get("resourceVersion")
        if not version:
            return
        updated = copy.deepcopy(dict(sts))
        updated.setdefault("spec", {})["replicas"] = replicas
        updated["metadata"]["resourceVersion"] = version
        self.owner.store.put(updated)

    async def _event(self, body: dict[str, Any], type_: str, reason: str, message: str, now: float) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(
            self.owner.executor, self.owner.api.post_event, dict(body), type_, reason, message, _iso(now)
        )
