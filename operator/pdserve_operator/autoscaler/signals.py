"""Typed observations of one PDService at one instant: the only input of the model and the policy.

Two sources meet here. Kubernetes (the operator's cache) says which pods exist and in what state (`PodState`):
that is the truth about replicas, and it decides which Prometheus series count at all (a deleted pod's last
gauge value must never ratchet a decision). Prometheus says how the live pods behave over a window
(`PodSample`, `PoolSignals`, `RouterSignals`).

Every measured value is `float | None`: None means "not observed" (query failed, no series, no traffic in the
window for a quantile), never zero. Zero load and unknown load are different facts: a Prometheus outage read as
zero load once broke a planner's minimum (Dynamo). Each pool carries `freshness_s` and `completeness` so the
policy can refuse to act on old or partial data.

Units: seconds, tokens per second, requests per second; KV usage in [0, 1].
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, Role] = ("prefill", "decode")


class PodPhase(enum.StrEnum):
    """Where a pod is in its life, as far as scaling cares."""

    #: Not scheduled: no node has room (no free GPU); more replicas would only add more of these.
    PENDING = "Pending"
    #: Scheduled and starting (image pull, weights, compilation): it will serve soon.
    STARTING = "Starting"
    READY = "Ready"
    #: Being deleted (draining): neither capacity nor a reason to wait.
    TERMINATING = "Terminating"


@dataclass(frozen=True, slots=True)
class PodState:
    """One engine pod as Kubernetes reports it."""

    name: str
    role: Role
    phase: PodPhase
    #: Seconds since the pod became Ready (None unless READY): the warm-up filter's input.
    ready_for_s: float | None = None


@dataclass(frozen=True, slots=True)
class PodSample:
    """One live pod's behaviour over the window (Prometheus)."""

    pod: str
    #: The pool's load on this pod: uncached prompt tokens computed per second (prefill), or tokens generated
    #: per second (decode).
    load: float | None = None
    #: The pool's latency quantile on this pod at the SLO percentile: engine TTFT (prefill), ITL (decode).
    latency_s: float | None = None
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    #: Age of the pod's newest scraped sample; None when Prometheus has no sample of it.
    sample_age_s: float | None = None
    #: Ready for at least the warm-up period: its (load, latency) pair may teach the capacity model.
    settled: bool = False


@dataclass(frozen=True, slots=True)
class PoolSignals:
    """One engine pool: its replicas (Kubernetes) and its behaviour over the window (Prometheus, live pods)."""

    role: Role
    #: Replicas the pool is asked to run now (the StatefulSet's spec.replicas).
    desired: int
    ready: int = 0
    starting: int = 0
    pending: int = 0
    pods: tuple[PodSample, ...] = ()
    #: Requests the engines finished per second.
    request_rate: float | None = None
    prompt_tokens_rate: float | None = None
    #: Prompt tokens computed here per second (prefix-cache hits and pulled KV excluded): the prefill work.
    uncached_tokens_rate: float | None = None
    generated_tokens_rate: float | None = None
    #: Prompt length quantile (tokens) at the SLO percentile, of requests the engines finished.
    prompt_tokens_quantile: float | None = None
    #: Sums over live pods of the gauges at the instant of the query.
    running: float | None = None
    waiting: float | None = None
    #: Waiting for a sequence slot or KV blocks: this pool is short of capacity.
    waiting_capacity: float | None = None
    #: Waiting on something else, e.g. a decode request whose KV is still being pulled from prefill (vLLM's
    #: reason "deferred"): holds KV blocks but says nothing about this pool's capacity.
    waiting_deferred: float | None = None
    #: Mean KV-cache usage of live pods.
    kv_usage: float | None = None
    #: Quantiles at the SLO percentile over the window, of the live pods together.
    engine_ttft_s: float | None = None
    engine_itl_s: float | None = None
    queue_time_s: float | None = None
    #: Decode only: time to pull a request's KV from prefill (NIXL transfer).
    kv_transfer_s: float | None = None
    #: Age of the oldest newest-sample among ready pods (the stalest ready pod); None when none is scraped.
    freshness_s: float | None = None
    #: Share of ready pods that Prometheus has fresh samples of.
    completeness: float = 0.0

    @property
    def in_progress(self) -> int:
        """Replicas asked for but not ready yet (starting or pending)."""
        return self.starting + self.pending

    def settled_pairs(self) -> list[tuple[float, float]]:
        """(load, latency) of settled pods: what the capacity model learns from."""
        return [
            (p.load, p.latency_s)
            for p in self.pods
            if p.settled and p.load is not None and p.latency_s is not None and p.load > 0
        ]


@dataclass(frozen=True, slots=True)
class RouterSignals:
    """What clients see, measured by the service's routers (their histograms include every hop)."""

    ttft_s: float | None = None
    #: TTFT of requests that went prefill -> decode (route="pd"): the ones prefill capacity affects.
    ttft_pd_s: float | None = None
    itl_s: float | None = None
    #: Finished requests per second, all routes.
    request_rate: float | None = None
    freshness_s: float | None = None
    #: Requests waiting in the routers for an engine with room (late binding), summed over router replicas at the
    #: query's instant: a pool's backlog once it waits in the routers instead of in the engines' queues (the
    #: engines' own waiting gauges and TTFT no longer show it). None when unknown.
    queued_prefill_requests: float | None = None
    #: Their uncached prompt tokens: the prefill work the routers hold back.
    queued_prefill_tokens: float | None = None
    #: Requests waiting in the routers for a decode engine with a free sequence.
    queued_decode_requests: float | None = None


@dataclass(frozen=True, slots=True)
class ServiceSignals:
    """Everything observed of one PDService at `at` (seconds, the clock the caller uses for all times)."""

    at: float
    window_s: float
    #: The SLO percentile the quantiles were computed at (50, 90, 95 or 99).
    percentile: int
    prefill: PoolSignals
    decode: PoolSignals
    router: RouterSignals = field(default_factory=RouterSignals)
    #: Queries that failed ("name: error"), for the decision's message.
    errors: tuple[str, ...] = ()
    #: Names of the queries that failed (`queries.py`), for the operator's query error counter.
    failed_queries: tuple[str, ...] = ()

    def pool(self, role: Role) -> PoolSignals:
        """The signals of one pool."""
        return self.prefill if role == "prefill" else self.decode


def count_pods(pods: Sequence[PodState], role: Role) -> tuple[int, int, int]:
    """(ready, starting, pending) pods of one role; terminating pods count nowhere."""
    ready = starting = pending = 0
    for pod in pods:
        if pod.role != role:
            continue
        if pod.phase is PodPhase.READY:
            ready += 1
        elif pod.phase is PodPhase.STARTING:
            starting += 1
        elif pod.phase is PodPhase.PENDING:
            pending += 1
    return ready, starting, pending
