"""What a control tick sees of the replayed service, built the way the collector builds it from Prometheus.

Each tick snapshots every live replica's cumulative counters and histograms (what a scrape would read) and the
router's histograms. A window is the difference between now and the snapshot `window_s` ago (`rate()` and
`sum by (le) (rate(..._bucket))`); a replica younger than the window counts from its start. Gauges are read at
the tick. Quantiles go through Prometheus' algorithm over the real bucket boundaries. Only live replicas count
(ready and draining: they are scraped; starting ones export nothing yet), and only ready ones that have been
ready for `warmup_s` are marked settled.

The result is the autoscaler's own `ServiceSignals`, plus the utilisation figures an HPA-style policy reads
(prefill: share of time the engine was busy, like DCGM's GPU utilisation; decode: running sequences over
max_num_seqs), the router's TTFT/ITL quantiles at p90 for llm-d's SLO law, and for Dynamo's planner each ready
engine's scheduler state at the tick (what its forward-pass metrics report) and the frontend's cumulative request
and token counts (what its throughput path differences over an interval).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve_dev.replay import histogram
from pdserve_dev.replay.engines import (
    ROUTER_ITL_BUCKETS,
    ROUTER_TTFT_BUCKETS,
    DecodeEngine,
    EngineCounters,
    Job,
    PrefillEngine,
)
from pdserve_dev.replay.histogram import Histogram
from pdserve_operator.autoscaler.signals import PodSample, PoolSignals, Role, RouterSignals, ServiceSignals

if TYPE_CHECKING:
    from pdserve_dev.replay.cluster import ReplayCluster, ReplayConfig, Replica

ROUTES = ("pd", "decode-only", "fallback")
#: llm-d's recording rules take p90 over 1-minute bucket rates.
LLMD_WINDOW_S = 60.0


@dataclass(frozen=True, slots=True)
class EngineSample:
    """One ready engine's scheduler state at the tick, the fields of Dynamo's forward-pass metrics (FPM) its
    planner's load path reads: what is in the running batch and what waits behind it."""

    name: str
    #: Requests in the running batch (prefill: being prefilled; decode: decoding).
    scheduled_requests: int = 0
    #: Decode: summed context (KV tokens) of the running batch.
    scheduled_kv_tokens: int = 0
    #: Requests on the engine that are not in the running batch (waiting, or pulling / holding their KV).
    queued_requests: int = 0
    #: Prefill: prompt tokens of the requests waiting for the batch.
    queued_prefill_tokens: int = 0
    #: Decode: KV tokens the queued requests hold or will hold on joining (their prompts).
    queued_kv_tokens: int = 0
    #: Decode: the engine's latest step (decoding sequences, their KV tokens, wall seconds), None before any.
    last_pass: tuple[int, int, float] | None = None


@dataclass(frozen=True, slots=True)
class FrontendTotals:
    """The frontend's cumulative counters of finished requests (Dynamo's planner differences them per interval:
    requests, and input/output tokens for the mean ISL and OSL)."""

    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Observation:
    """One tick's view: the autoscaler's signals and what the baseline policies read."""

    at: float
    signals: ServiceSignals
    #: Per pool: prefill busy share, decode running / max_num_seqs (mean over ready replicas); None = no data.
    utilisation: dict[Role, float | None]
    #: The router's TTFT and per-request TPOT at p90 over the last minute (what llm-d's SLO law reads).
    ttft_p90: float | None
    itl_p90: float | None
    #: Per pool, every ready engine's scheduler state now (Dynamo's planner's load path).
    engines: dict[Role, tuple[EngineSample, ...]] = field(default_factory=lambda: {"prefill": (), "decode": ()})
    frontend: FrontendTotals = field(default_factory=FrontendTotals)


@dataclass(frozen=True, slots=True)
class _Snap:
    at: float
    requests: int
    prompt_tokens: int
    local_tokens: int
    generated_tokens: int
    busy_s: float
    ttft: tuple[int, ...]
    itl: tuple[int, ...]
    queue: tuple[int, ...]
    kv: tuple[int, ...]
    prompt_hist: tuple[int, ...]


def _snap(at: float, c: EngineCounters) -> _Snap:
    return _Snap(
        at,
        c.requests,
        c.prompt_tokens,
        c.local_tokens,
        c.generated_tokens,
        c.busy_s,
        c.engine_ttft.snapshot(),
        c.engine_itl.snapshot(),
        c.queue_time.snapshot(),
        c.kv_transfer.snapshot(),
        c.prompt_tokens_hist.snapshot(),
    )


@dataclass(frozen=True, slots=True)
class _Delta:
    """One replica's window: counter deltas over `span` seconds and per-bucket histogram counts."""

    span: float
    requests: int
    prompt_tokens: int
    local_tokens: int
    generated_tokens: int
    busy_s: float
    ttft: list[int]
    itl: list[int]
    queue: list[int]
    kv: list[int]
    prompt_hist: list[int]


class Observer:
    """Keeps the snapshots and builds each tick's `Observation`."""

    def __init__(self, config: ReplayConfig, cluster: ReplayCluster) -> None:
        self.config = config
        self.cluster = cluster
        self._history: dict[str, deque[_Snap]] = {}
        self.router_ttft_hist = {route: Histogram(ROUTER_TTFT_BUCKETS) for route in ROUTES}
        self.router_itl_hist = Histogram(ROUTER_ITL_BUCKETS)
        self.router_requests = 0
        self.router_prompt_tokens = 0
        self.router_output_tokens = 0
        #: Per finished request: mean time per output token (llm-d's TPOT; pdserve's router exports per-chunk ITL).
        self.router_tpot_hist = Histogram(ROUTER_ITL_BUCKETS)
        self._router_history: deque[_RouterSnap] = deque()

    # Router-side recording (called by the cluster as requests progress).

    def router_ttft(self, job: Job, ttft: float) -> None:
        self.router_ttft_hist[job.route].observe(ttft)

    def router_itl(self, gap: float, times: int) -> None:
        self.router_itl_hist.observe(gap, times)

    def router_finished(self, job: Job) -> None:
        self.router_requests += 1
        self.router_prompt_tokens += job.prompt
        self.router_output_tokens += job.output
        if job.output > 1:
            self.router_tpot_hist.observe(job.tpot)

    def forget(self, replica: Replica) -> None:
        """A replica is gone: its series vanish (the collector's live-pod filter)."""
        self._history.pop(replica.name, None)

    # The tick.

    def tick(self, now: float) -> Observation:
        config = self.config
        horizon = now - config.window_s + 1e-6
        deltas: dict[str, _Delta] = {}
        for role in ("prefill", "decode"):
            for replica in self.cluster.replicas[role]:
                if replica.state not in ("ready", "draining"):
                    continue
                history = self._history.setdefault(replica.name, deque())
                snap = _snap(now, replica.engine.counters)
                history.append(snap)
                while len(history) > 1 and history[1].at <= horizon:
                    history.popleft()
                base = history[0] if history[0].at <= horizon else None
                start = base.at if base is not None else max(replica.ready_at, now - config.window_s)
                deltas[replica.name] = _delta(snap, base, max(now - start, 1e-9))
        router_ttft, router_ttft_pd, router_itl, router_rate, ttft_p90, itl_p90 = self._router(now, horizon)
        q = config.slo.percentile / 100.0
        gate = self.cluster.gate
        prefill, prefill_util = self._pool("prefill", now, deltas, q)
        decode, decode_util = self._pool("decode", now, deltas, q)
        signals = ServiceSignals(
            at=now,
            window_s=config.window_s,
            percentile=config.slo.percentile,
            prefill=prefill,
            decode=decode,
            router=RouterSignals(
                ttft_s=router_ttft,
                ttft_pd_s=router_ttft_pd,
                itl_s=router_itl,
                request_rate=router_rate,
                freshness_s=0.0,
                # The router's queue gauges (`pdserve_router_queue_*`), 0 without late binding.
                queued_prefill_requests=float(gate.waiting("prefill")) if gate else 0.0,
                queued_prefill_tokens=float(gate.waiting_tokens("prefill")) if gate else 0.0,
                queued_decode_requests=float(gate.waiting("decode")) if gate else 0.0,
            ),
        )
        frontend = FrontendTotals(self.router_requests, self.router_prompt_tokens, self.router_output_tokens)
        engines: dict[Role, tuple[EngineSample, ...]] = {
            "prefill": self._engines("prefill"),
            "decode": self._engines("decode"),
        }
        return Observation(
            now, signals, {"prefill": prefill_util, "decode": decode_util}, ttft_p90, itl_p90, engines, frontend
        )

    def _engines(self, role: Role) -> tuple[EngineSample, ...]:
        """Every ready engine's scheduler state now (draining ones are leaving, starting ones report nothing)."""
        out: list[EngineSample] = []
        for replica in self.cluster.replicas[role]:
            if replica.state != "ready":
                continue
            engine = replica.engine
            if isinstance(engine, PrefillEngine):
                running, waiting = engine.gauges()
                queued = sum(job.prompt for job in engine.waiting)
                out.append(EngineSample(replica.name, running, 0, waiting, queued_prefill_tokens=queued))
            else:
                assert isinstance(engine, DecodeEngine)
                running = engine.batch
                # Requests holding or about to hold KV outside the batch (pulling, pulled, joining) and those
                # still waiting for admission: vLLM's waiting queue, KV included.
                queued_kv = engine.kv_other + sum(job.prompt for job in engine.waiting)
                out.append(
                    EngineSample(
                        replica.name,
                        running,
                        engine.context,
                        engine.load - running,
                        queued_kv_tokens=queued_kv,
                        last_pass=engine.last_pass,
                    )
                )
        return tuple(out)

    def _router(
        self, now: float, horizon: float
    ) -> tuple[float | None, float | None, float | None, float | None, float | None, float | None]:
        snap = _RouterSnap(
            now,
            self.router_requests,
            {route: hist.snapshot() for route, hist in self.router_ttft_hist.items()},
            self.router_itl_hist.snapshot(),
            self.router_tpot_hist.snapshot(),
        )
        history = self._router_history
        history.append(snap)
        keep = min(horizon, now - LLMD_WINDOW_S + 1e-6)
        while len(history) > 1 and history[1].at <= keep:
            history.popleft()
        base = _base(history, horizon)
        span = now - base.at if base is not None else now
        ttft = {route: histogram.window(snap.ttft[route], base.ttft[route] if base else None) for route in ROUTES}
        itl = histogram.window(snap.itl, base.itl if base else None)
        all_ttft = histogram.merge(ttft.values(), len(ROUTER_TTFT_BUCKETS) + 1)
        q = self.config.slo.percentile / 100.0
        rate = (snap.requests - (base.requests if base else 0)) / max(span, 1e-9)
        # llm-d's law reads p90 TTFT and TPOT over 1-minute rates, whatever window the collector uses.
        minute = _base(history, now - LLMD_WINDOW_S + 1e-6)
        ttft_1m = histogram.merge(
            (histogram.window(snap.ttft[r], minute.ttft[r] if minute else None) for r in ROUTES),
            len(ROUTER_TTFT_BUCKETS) + 1,
        )
        tpot_1m = histogram.window(snap.tpot, minute.tpot if minute else None)
        return (
            histogram.quantile(q, ROUTER_TTFT_BUCKETS, all_ttft),
            histogram.quantile(q, ROUTER_TTFT_BUCKETS, ttft["pd"]),
            histogram.quantile(q, ROUTER_ITL_BUCKETS, itl),
            rate,
            histogram.quantile(0.9, ROUTER_TTFT_BUCKETS, ttft_1m),
            histogram.quantile(0.9, ROUTER_ITL_BUCKETS, tpot_1m),
        )

    def _pool(self, role: Role, now: float, deltas: dict[str, _Delta], q: float) -> tuple[PoolSignals, float | None]:
        config = self.config
        replicas = self.cluster.replicas[role]
        live = [r for r in replicas if r.name in deltas]
        ready = [r for r in replicas if r.state == "ready"]
        starting = sum(r.state == "starting" for r in replicas)
        pods: list[PodSample] = []
        running_total = waiting_total = capacity_total = deferred_total = 0.0
        kv_total = 0.0
        utilisation: list[float] = []
        for replica in live:
            delta = deltas[replica.name]
            engine = replica.engine
            kv_usage: float | None = None
            if isinstance(engine, PrefillEngine):
                running, waiting = engine.gauges()
                capacity, deferred = waiting, 0
                load = delta.local_tokens / delta.span
                latency = _q(q, delta.ttft, engine.counters.engine_ttft)
                busy = min(delta.busy_s / delta.span, 1.0)
            else:
                assert isinstance(engine, DecodeEngine)
                running, capacity, deferred, kv_usage = engine.gauges()
                waiting = capacity + deferred
                kv_total += kv_usage
                load = delta.generated_tokens / delta.span
                latency = _q(q, delta.itl, engine.counters.engine_itl)
                busy = running / engine.timing.max_num_seqs
            running_total += running
            waiting_total += waiting
            capacity_total += capacity
            deferred_total += deferred
            if replica.state == "ready":
                utilisation.append(busy)
                pods.append(
                    PodSample(
                        pod=replica.name,
                        load=load,
                        latency_s=latency,
                        running=float(running),
                        waiting=float(waiting),
                        kv_usage=kv_usage,
                        sample_age_s=0.0,
                        settled=now - replica.ready_at >= config.warmup_s,
                    )
                )
        window = list(deltas[r.name] for r in live)
        counters = live[0].engine.counters if live else None
        signals = PoolSignals(
            role=role,
            desired=len(ready) + starting,
            ready=len(ready),
            starting=starting,
            pending=0,
            pods=tuple(pods),
            request_rate=_rate(window, "requests"),
            prompt_tokens_rate=_rate(window, "prompt_tokens"),
            uncached_tokens_rate=_rate(window, "local_tokens"),
            generated_tokens_rate=_rate(window, "generated_tokens"),
            prompt_tokens_quantile=_merged_q(q, window, "prompt_hist", counters.prompt_tokens_hist)
            if counters
            else None,
            running=running_total if live else None,
            waiting=waiting_total if live else None,
            waiting_capacity=capacity_total if live else None,
            waiting_deferred=deferred_total if live else None,
            kv_usage=(kv_total / len(live)) if live and role == "decode" else None,
            engine_ttft_s=_merged_q(q, window, "ttft", counters.engine_ttft) if counters else None,
            engine_itl_s=_merged_q(q, window, "itl", counters.engine_itl) if counters else None,
            queue_time_s=_merged_q(q, window, "queue", counters.queue_time) if counters else None,
            kv_transfer_s=_merged_q(q, window, "kv", counters.kv_transfer) if counters and role == "decode" else None,
            freshness_s=0.0 if live else None,
            completeness=1.0 if live else 0.0,
        )
        mean_util = sum(utilisation) / len(utilisation) if utilisation else None
        return signals, mean_util


@dataclass(frozen=True, slots=True)
class _RouterSnap:
    at: float
    requests: int
    ttft: dict[str, tuple[int, ...]]
    itl: tuple[int, ...]
    tpot: tuple[int, ...]


def _base(history: deque[_RouterSnap], at: float) -> _RouterSnap | None:
    """The newest snapshot taken at or before `at`, None when history starts later."""
    best: _RouterSnap | None = None
    for snap in history:
        if snap.at <= at:
            best = snap
        else:
            break
    return best


def _delta(now: _Snap, base: _Snap | None, span: float) -> _Delta:
    if base is None:
        return _Delta(
            span,
            now.requests,
            now.prompt_tokens,
            now.local_tokens,
            now.generated_tokens,
            now.busy_s,
            list(now.ttft),
            list(now.itl),
            list(now.queue),
            list(now.kv),
            list(now.prompt_hist),
        )
    return _Delta(
        span,
        now.requests - base.requests,
        now.prompt_tokens - base.prompt_tokens,
        now.local_tokens - base.local_tokens,
        now.generated_tokens - base.generated_tokens,
        now.busy_s - base.busy_s,
        histogram.window(now.ttft, base.ttft),
        histogram.window(now.itl, base.itl),
        histogram.window(now.queue, base.queue),
        histogram.window(now.kv, base.kv),
        histogram.window(now.prompt_hist, base.prompt_hist),
    )


def _rate(window: Sequence[_Delta], name: str) -> float | None:
    if not window:
        return None
    return sum(float(getattr(d, name)) / d.span for d in window)


def _q(q: float, counts: Sequence[int], like: Histogram) -> float | None:
    return histogram.quantile(q, like.bounds, counts)


def _merged_q(q: float, window: Sequence[_Delta], name: str, like: Histogram) -> float | None:
    merged = histogram.merge((getattr(d, name) for d in window), len(like.bounds) + 1)
    return histogram.quantile(q, like.bounds, merged)
