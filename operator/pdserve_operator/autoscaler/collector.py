"""The collector (IO): PromQL (`queries.py`) through `prometheus.PrometheusClient` -> `ServiceSignals`.

`Collector.collect(target, pods, now)` evaluates every query at the instant `now` (all of a tick's queries see
the same moment), restricted to the pods that exist now and that the pools own (`pods`, from the operator's cache:
`ownership` keeps out pods that merely carry a pool's labels; the pod regex lists them by name, so a pod of
another owner never counts, at no cost beyond the regex the queries had already), and folds the answers into
typed signals. It never raises for Prometheus: a failed or refused query leaves the signals it feeds at None and
is listed in `ServiceSignals.errors`, which the policy turns into a fail-static hold. Freshness is the age of each
ready pod's last successful scrape (`timestamp(up == 1)`), completeness the share of ready pods scraped at all.

What makes a tick's signals missing rather than zero:
- a query that failed, or was not sent: once one finds Prometheus unreachable the rest are not sent (an outage
  costs one failure per tick, not one per query); once the tick's one deadline (`deadline_s`,
  `--prometheus-timeout`, for all its queries together) has passed, the rest are not sent either, and the query
  in flight is cancelled (`prometheus.py`: a Prometheus that trickles its answer cannot stretch a tick);
- a query that must have a series for every pod Prometheus scrapes (`Query.per_scraped_pod`: the engines create
  those series at start) but has none for a scraped ready pod: the metric is missing (renamed by a new vLLM, not
  exported), and reading it as zero load once dropped both pools to their minimum.

Retries are the loop's business (the next tick).
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdserve_operator.autoscaler.prometheus import PrometheusClient, PrometheusConnectionError
from pdserve_operator.autoscaler.queries import BY_NAME, Query, Scope, render
from pdserve_operator.autoscaler.signals import (
    ROLES,
    PodPhase,
    PodSample,
    PodState,
    PoolSignals,
    Role,
    RouterSignals,
    ServiceSignals,
    count_pods,
)


class PromQL(Protocol):
    """The part of `prometheus.PrometheusClient` the collector uses."""

    async def query(self, promql: str, at: float) -> list[dict[str, Any]]: ...

    async def close(self) -> None: ...


def connect(url: str) -> PrometheusClient:
    """A client for the collector: its own session, POST queries, no timeout of its own (the collector's one
    deadline per tick bounds it) and no retries (the next tick is the retry)."""
    return PrometheusClient(url)


@dataclass(frozen=True, slots=True)
class SeriesLabels:
    """Names of the target labels the scrape configuration puts on pdserve's engine and router series."""

    namespace: str = "namespace"
    pod: str = "pod"
    #: The pool: prefill, decode or router (the pod's pdserve.io/role label).
    pool: str = "pool"
    #: The PDService the pod belongs to (app.kubernetes.io/instance).
    service: str = "pdservice"


@dataclass(frozen=True, slots=True)
class Target:
    """The PDService to observe and how: where it is, its SLO percentile, the window of its rates and quantiles,
    its warm-up, and the replicas each pool is asked for (the service's `AutoscalerConfig` and its StatefulSets)."""

    namespace: str
    name: str
    percentile: int
    #: The rate and quantile window of every query (seconds).
    window_s: float
    #: Pods ready for less than this (seconds) are not settled: they teach the capacity model nothing.
    warmup_s: float
    #: Each pool's StatefulSet spec.replicas.
    desired: Mapping[Role, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Tick:
    """What every query of one tick shares."""

    now: float
    quantile: float
    window_s: float
    #: The event loop's time by which every query of the tick must have been answered.
    deadline: float
    errors: list[str]
    failed: list[str] = field(default_factory=list)
    #: Set by the first query that could not reach Prometheus, or found the deadline passed: the rest of the tick
    #: is not sent.
    stopped: str | None = None


@dataclass
class _Answers:
    """One tick's query results for one scope (a pool or the routers)."""

    values: dict[str, list[dict[str, Any]] | None] = field(default_factory=dict)

    def by_pod(self, name: str) -> dict[str, float] | None:
        result = self.values.get(name)
        if result is None:
            return None
        out: dict[str, float] = {}
        for series in result:
            value = _number(series)
            pod = series.get("metric", {}).get("pod")
            if value is not None and pod is not None:
                out[pod] = value
        return out

    def scalar(self, name: str) -> float | None:
        result = self.values.get(name)
        if not result:
            return None
        return _number(result[0])

    def by_label(self, name: str, label: str) -> dict[str, float] | None:
        result = self.values.get(name)
        if result is None:
            return None
        out: dict[str, float] = {}
        for series in result:
            value = _number(series)
            key = series.get("metric", {}).get(label)
            if value is not None and key is not None:
                out[key] = value
        return out


def _number(series: Mapping[str, Any]) -> float | None:
    try:
        value = float(series["value"][1])
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


ENGINE_QUERIES = tuple(query for query in BY_NAME.values() if query.scope is Scope.ENGINE)
ROUTER_QUERIES = tuple(query for query in BY_NAME.values() if query.scope is Scope.ROUTER)


class Collector:
    """Reads one PDService's signals from Prometheus."""

    def __init__(self, client: PromQL, *, deadline_s: float, labels: SeriesLabels | None = None) -> None:
        """`deadline_s`: how long a tick's queries may take together (`--prometheus-timeout`)."""
        self.client = client
        self.deadline_s = deadline_s
        self.labels = labels or SeriesLabels()

    async def collect(
        self, target: Target, pods: Sequence[PodState], now: float, routers: Sequence[str] = ()
    ) -> ServiceSignals:
        """The signals of `target` at `now` (Unix seconds), counting only the series of the engine `pods` and
        the router pods named in `routers` that exist now."""
        deadline = asyncio.get_running_loop().time() + self.deadline_s
        tick = _Tick(now, target.percentile / 100.0, target.window_s, deadline, [])
        pools = {role: await self._pool(target, role, pods, tick) for role in ROLES}
        router = await self._router(target, routers, tick)
        return ServiceSignals(
            at=now,
            window_s=target.window_s,
            percentile=target.percentile,
            prefill=pools["prefill"],
            decode=pools["decode"],
            router=router,
            errors=tuple(tick.errors),
            failed_queries=tuple(tick.failed),
        )

    async def close(self) -> None:
        """Close the client's connections (the loop ends)."""
        await self.client.close()

    # ---------------------------------------------------------------------------------------------- queries

    def selector(self, target: Target, pool: str, pod_names: Sequence[str]) -> str:
        """The label selector of one pool's live pods."""
        names = "|".join(_regex_literal(name) for name in sorted(pod_names))
        lab = self.labels
        return (
            f'{lab.namespace}="{target.namespace}",{lab.service}="{target.name}",{lab.pool}="{pool}",'
            f'{lab.pod}=~"{names}"'
        )

    async def _ask(self, queries: Sequence[Query], selector: str, tick: _Tick, scope: str) -> _Answers:
        answers = _Answers()
        for query in queries:
            answers.values[query.name] = None
            tick.failed.append(query.name)
            if tick.stopped is not None:
                continue  # reported once, by the query that found Prometheus unreachable or the deadline passed
            promql = render(query, selector=selector, window_s=tick.window_s, quantile=tick.quantile)
            try:
                async with asyncio.timeout_at(tick.deadline):
                    answers.values[query.name] = await self.client.query(promql, tick.now)
            except TimeoutError:
                tick.stopped = (
                    f"{scope} {query.name}: the tick's deadline of {self.deadline_s:g} s for its queries passed"
                )
                tick.errors.append(tick.stopped)
                continue
            except Exception as exc:  # a failing dependency is reported, never raised: the policy holds
                error = f"{scope} {query.name}: {type(exc).__name__}: {exc}"[:300]
                tick.errors.append(error)
                if isinstance(exc, PrometheusConnectionError):
                    tick.stopped = error
                continue
            tick.failed.pop()
        return answers

    def _require_series(
        self, answers: _Answers, scraped: set[str], scraped_for_window: set[str], tick: _Tick, scope: str
    ) -> None:
        """Make each answered query that must have a series per scraped pod (`Query.per_scraped_pod`) missing when
        it lacks one for a scraped ready pod (module docstring): the metric is not there, it is not zero. A rate
        is only required of pods ready for the whole window (`scraped_for_window`): a pod scraped once has no
        rate yet."""
        for name, values in list(answers.values.items()):
            query = BY_NAME[name]
            if values is None or not query.per_scraped_pod:
                continue
            found = {series.get("metric", {}).get("pod") for series in values}
            absent = sorted((scraped_for_window if query.spans_window else scraped) - found)
            if absent:
                answers.values[name] = None
                tick.failed.append(name)
                tick.errors.append(
                    f"{scope} {name}: no series for pod {', '.join(absent[:3])} although Prometheus scrapes it "
                    "(the metric is missing or renamed; not read as zero)"
                )

    # ------------------------------------------------------------------------------------------------ pools

    async def _pool(self, target: Target, role: Role, pods: Sequence[PodState], tick: _Tick) -> PoolSignals:
        now = tick.now
        ready, starting, pending = count_pods(pods, role)
        desired = target.desired.get(role, ready + starting + pending)
        live = [pod for pod in pods if pod.role == role]
        if not live:
            return PoolSignals(role=role, desired=desired, ready=ready, starting=starting, pending=pending)
        answers = await self._ask(ENGINE_QUERIES, self.selector(target, role, [p.name for p in live]), tick, role)
        scraped = answers.by_pod("last_scrape")
        scraped_ready = {pod.name for pod in live if pod.phase is PodPhase.READY} & set(scraped or {})
        whole_window = {
            pod.name for pod in live if pod.name in scraped_ready and (pod.ready_for_s or 0.0) >= target.window_s
        }
        self._require_series(answers, scraped_ready, whole_window, tick, role)
        load_query = "uncached_tokens" if role == "prefill" else "generated_tokens"
        latency_query = "engine_ttft_by_pod" if role == "prefill" else "engine_itl_by_pod"
        loads = answers.by_pod(load_query) or {}
        latencies = answers.by_pod(latency_query) or {}
        running = answers.by_pod("running")
        waiting = answers.by_pod("waiting")
        kv = answers.by_pod("kv_usage")
        samples: list[PodSample] = []
        ages: list[float] = []
        for pod in live:
            if pod.phase is not PodPhase.READY:
                continue
            age = None if scraped is None or pod.name not in scraped else max(0.0, now - scraped[pod.name])
            if age is not None:
                ages.append(age)
            samples.append(
                PodSample(
                    pod=pod.name,
                    load=loads.get(pod.name),
                    latency_s=latencies.get(pod.name),
                    running=None if running is None else running.get(pod.name),
                    waiting=None if waiting is None else waiting.get(pod.name),
                    kv_usage=None if kv is None else kv.get(pod.name),
                    sample_age_s=age,
                    settled=pod.ready_for_s is not None and pod.ready_for_s >= target.warmup_s,
                )
            )
        reasons = answers.by_label("waiting_by_reason", "reason")
        return PoolSignals(
            role=role,
            desired=desired,
            ready=ready,
            starting=starting,
            pending=pending,
            pods=tuple(samples),
            request_rate=_total(answers.by_pod("requests")),
            prompt_tokens_rate=_total(answers.by_pod("prompt_tokens")),
            uncached_tokens_rate=_total(answers.by_pod("uncached_tokens")),
            generated_tokens_rate=_total(answers.by_pod("generated_tokens")),
            prompt_tokens_quantile=answers.scalar("prompt_length"),
            running=_total(running),
            waiting=_total(waiting),
            waiting_capacity=None if reasons is None else reasons.get("capacity", 0.0),
            waiting_deferred=None if reasons is None else reasons.get("deferred", 0.0),
            kv_usage=(sum(kv.values()) / len(kv)) if kv else None,
            engine_ttft_s=answers.scalar("engine_ttft"),
            engine_itl_s=answers.scalar("engine_itl"),
            queue_time_s=answers.scalar("queue_time"),
            kv_transfer_s=answers.scalar("kv_transfer") if role == "decode" else None,
            freshness_s=max(ages) if ages else None,
            completeness=(len(ages) / ready) if ready else 0.0,
        )

    async def _router(self, target: Target, routers: Sequence[str], tick: _Tick) -> RouterSignals:
        if not routers:
            return RouterSignals()
        now = tick.now
        answers = await self._ask(ROUTER_QUERIES, self.selector(target, "router", routers), tick, "router")
        scraped = answers.by_pod("router_last_scrape")
        queued = answers.by_label("router_queue", "pool")
        tokens = answers.by_label("router_queue_tokens", "pool")
        return RouterSignals(
            ttft_s=answers.scalar("router_ttft"),
            ttft_pd_s=answers.scalar("router_ttft_pd"),
            itl_s=answers.scalar("router_itl"),
            request_rate=answers.scalar("router_requests"),
            freshness_s=max((max(0.0, now - t) for t in scraped.values()), default=None) if scraped else None,
            queued_prefill_requests=None if queued is None else queued.get("prefill", 0.0),
            queued_prefill_tokens=None if tokens is None else tokens.get("prefill", 0.0),
            queued_decode_requests=None if queued is None else queued.get("decode", 0.0),
        )


def _regex_literal(name: str) -> str:
    """A pod name as a regex matching only itself, written inside a PromQL string literal.

    Pod names are DNS-1123 subdomains ([a-z0-9] . -): only the dot means anything to a regex, and its escaping
    backslash must itself be escaped in PromQL's double-quoted string (Python's re.escape also escapes "-",
    which PromQL rejects as an unknown escape sequence).
    """
    if not _DNS_NAME.fullmatch(name):
        raise ValueError(f"not a Kubernetes object name: {name!r}")
    return name.replace(".", "\\\\.")


_DNS_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")


def _total(values: Mapping[str, float] | None) -> float | None:
    """Sum over live pods; None when the query failed, 0 when it answered with no series (no traffic)."""
    if values is None:
        return None
    return float(sum(values.values()))
