"""The replayed service: a router in front of a prefill pool and a decode pool, under one scaling policy.

Event loop: a heap of (time, sequence, callback) in virtual seconds. Arrivals, engine steps, KV pulls, replicas
becoming ready and control ticks are all events; nothing runs in wall-clock time.

- Router: a prompt of at least the threshold (`disaggregation_threshold`, or what a `ThresholdPublisher` scaler
  chose at its last tick) goes prefill -> decode ("pd"), a shorter one straight to decode ("decode-only"),
  as pdserve's router does without prefix hits; within a pool the
  replica with the least outstanding work gets it (prompt tokens for prefill, requests for decode). Draining
  and starting replicas get nothing new. With no ready prefill replica a long prompt falls back to decode.
- Replicas: a new replica holds its GPUs from the moment it is created and serves `startup_s` later. A removed
  replica that is still starting goes at once; a ready one drains (no new requests, in-flight ones finish) and
  goes when idle. GPU-seconds count from creation to going, drain included.
- Control: every `interval_s` the observer builds the tick's signals and the scaler answers the replicas it
  wants per pool; a changed pool is one scaling action.
- Outcome: per request TTFT (router arrival to first token) and TPOT, so attainment is the share of requests
  with TTFT <= target and TPOT <= target. TTFT is the client's: it counts from the request's arrival at the
  router, so every wait on the way (the router's queue, an engine's queue, the KV pull, joining the decode batch)
  is in it. Without `late_binding` this router dispatches on arrival and never sheds; with it, requests wait in the
  router until an engine has room (`gate`, the product's admission rule) and `Outcome.shed` counts the requests it
  refused or shed, each a miss.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from pdserve_dev.replay.engines import DecodeEngine, Job, PrefillEngine
from pdserve_dev.replay.gate import LateBinding, ReplayGate
from pdserve_dev.replay.observe import Observation, Observer
from pdserve_dev.replay.path import IDEAL, PathCosts
from pdserve_dev.replay.trace import Request
from pdserve_operator.autoscaler.model import Slo
from pdserve_operator.autoscaler.signals import Role
from pdserve_sim.presets import TimingParams


class Scaler(Protocol):
    """A scaling policy under test."""

    name: str

    def tick(self, observation: Observation) -> tuple[int, int]:
        """Replicas wanted for (prefill, decode)."""
        ...


@runtime_checkable
class ThresholdPublisher(Protocol):
    """A scaler that also chooses the disaggregation threshold (pdserve's, with bounds): the replay's router uses
    `threshold` from the tick after which it changed, as every router replica applies the published control."""

    threshold: int


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """The service and the control loop being replayed."""

    prefill_timing: TimingParams
    decode_timing: TimingParams
    slo: Slo
    #: Replicas of each pool at time 0, ready.
    initial: tuple[int, int]
    startup_s: float = 30.0
    interval_s: float = 15.0
    window_s: float = 30.0
    warmup_s: float = 60.0
    disaggregation_threshold: int = 256
    gpus_per_replica: tuple[int, int] = (1, 1)
    #: The router's late binding (`gate`); None: the router dispatches every request on arrival.
    late_binding: LateBinding | None = None
    #: What the hops of a request's path cost beyond the engines' steps (`path`); IDEAL: nothing.
    path: PathCosts = IDEAL
    #: When the first control tick comes (then every `interval_s`); None: at `interval_s`. A real operator's loop
    #: ticks at a phase of its own against the load's start; the closed loop measures it and replays it.
    tick_phase_s: float | None = None
    #: Seconds from the tick that chose a threshold to the router using it (the operator's publishing: status,
    #: the router-control ConfigMap, the routers' watch); 0: at once.
    control_delay_s: float = 0.0
    #: Age of what a tick reads: the autoscaler queries Prometheus, whose latest scrape of a target is up to a
    #: scrape interval old when the tick comes (half of it on average). The tick's observation is taken this much
    #: before the tick, which decides at its own time; 0: the tick sees the service at its instant.
    metrics_lag_s: float = 0.0


class Replica:
    """One engine pod."""

    __slots__ = ("created", "engine", "name", "ready_at", "removed_at", "role", "state")

    def __init__(self, name: str, role: Role, engine: PrefillEngine | DecodeEngine, created: float) -> None:
        self.name = name
        self.role: Role = role
        self.engine = engine
        self.created = created
        self.ready_at = created
        #: starting | ready | draining | gone
        self.state = "starting"
        self.removed_at: float | None = None


@dataclass(slots=True)
class Outcome:
    """What one replay produced."""

    policy: str
    jobs: list[Job]
    gpu_seconds: float
    actions: int
    #: (time, prefill wanted, decode wanted, prefill ready, decode ready) per tick.
    timeline: list[tuple[float, int, int, int, int]] = field(default_factory=list)
    end_s: float = 0.0
    kv_overflows: int = 0
    #: Requests refused or shed by the router (only with late binding). Each is a miss.
    shed: int = 0
    #: (time, threshold) from the start and at every change of the router's disaggregation threshold.
    thresholds: list[tuple[float, int]] = field(default_factory=list)

    def attainment(self, slo: Slo) -> float:
        """Share of requests meeting both TTFT (the client's, from router arrival) and TPOT targets; a shed
        request or one that never produced a token is a miss."""
        total = len(self.jobs) + self.shed
        if not total:
            return 1.0
        return sum(1 for job in self.jobs if met(job, slo)) / total


def met(job: Job, slo: Slo) -> bool:
    """Whether a request met both targets: a first token at the client within the TTFT target of its arrival at
    the router and a mean time per output token within the ITL target."""
    ttft = job.ttft
    return ttft is not None and ttft <= slo.ttft_s and job.tpot <= slo.itl_s


class ReplayCluster:
    """Replays `requests` through the service under `scaler`."""

    def __init__(self, config: ReplayConfig, requests: Sequence[Request], scaler: Scaler) -> None:
        self.config = config
        self.requests = requests
        self.scaler = scaler
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = itertools.count()
        self._names = itertools.count()
        self.replicas: dict[Role, list[Replica]] = {"prefill": [], "decode": []}
        self.gone: list[Replica] = []
        self.jobs: list[Job] = []
        self.observer = Observer(config, self)
        self.actions = 0
        self.timeline: list[tuple[float, int, int, int, int]] = []
        self._unfinished = 0
        self._next_request = 0
        self.gate = ReplayGate(config.late_binding, self) if config.late_binding is not None else None
        #: The threshold the router uses now: the configured one until a scaler publishes another.
        self.threshold = config.disaggregation_threshold
        self.thresholds: list[tuple[float, int]] = [(0.0, self.threshold)]
        #: The threshold the scaler chose last (the router uses it `control_delay_s` after that tick).
        self._chosen = self.threshold

    # --------------------------------------------------------------------------------------------- events

    def schedule(self, at: float, callback: Callable[[float], None]) -> None:
        heapq.heappush(self._events, (at, next(self._seq), callback))

    def run(self) -> Outcome:
        """Replay every request to completion."""
        p0, d0 = self.config.initial
        for role, count in (("prefill", p0), ("decode", d0)):
            for _ in range(count):
                self._add_replica(role, 0.0, startup=0.0)  # type: ignore[arg-type]
        self._unfinished = len(self.requests)
        if self.requests:
            self.schedule(self.requests[0].arrival, self._arrive)
        phase = self.config.tick_phase_s
        self._schedule_tick(self.config.interval_s if phase is None else phase)
        events = self._events
        while events and self._unfinished > 0:
            at, _, callback = heapq.heappop(events)
            self.now = at
            callback(at)
        end = self.now
        gpu = 0.0
        gpus = dict(zip(("prefill", "decode"), self.config.gpus_per_replica, strict=True))
        for replica in [*self.gone, *self.replicas["prefill"], *self.replicas["decode"]]:
            until = replica.removed_at if replica.removed_at is not None else end
            gpu += (until - replica.created) * gpus[replica.role]
        overflows = sum(
            r.engine.kv_overflows for r in [*self.gone, *self.replicas["decode"]] if isinstance(r.engine, DecodeEngine)
        )
        shed = self.gate.shed if self.gate is not None else 0
        return Outcome(
            self.scaler.name, self.jobs, gpu, self.actions, self.timeline, end, overflows, shed, self.thresholds
        )

    # --------------------------------------------------------------------------------------------- router

    def _arrive(self, now: float) -> None:
        request = self.requests[self._next_request]
        self._next_request += 1
        if self._next_request < len(self.requests):
            self.schedule(self.requests[self._next_request].arrival, self._arrive)
        if self.gate is not None:
            long = request.prompt >= self.threshold
            serving = long and any(r.state == "ready" for r in self.replicas["prefill"])
            route = "pd" if serving else "fallback" if long else "decode-only"
            self.gate.arrive(self._job(request, route), "prefill" if route == "pd" else "decode", now)
            return
        prefill = self._pick("prefill")
        if request.prompt >= self.threshold and prefill is not None:
            job = self._job(request, "pd")
            self.jobs.append(job)
            engine = prefill.engine
            assert isinstance(engine, PrefillEngine)
            engine.send(job, now, self.config.path.dispatch_s("pd", job.prompt))
            return
        job = self._job(request, "decode-only" if request.prompt < self.threshold else "fallback")
        self.jobs.append(job)
        self._to_decode(job, now, self.config.path.dispatch_s(job.route, job.prompt))

    def _job(self, request: Request, route: str) -> Job:
        job = Job(request, route)
        job.client_s = self.config.path.client.seconds(request.prompt)
        return job

    def _pick(self, role: Role) -> Replica | None:
        best: Replica | None = None
        best_load = 0
        for replica in self.replicas[role]:
            if replica.state != "ready":
                continue
            engine = replica.engine
            load = engine.outstanding_tokens if isinstance(engine, PrefillEngine) else engine.load
            if best is None or load < best_load:
                best, best_load = replica, load
        return best

    def _prefilled(self, job: Job, now: float) -> None:
        handoff = self.config.path.handoff_s(job.prompt)
        if self.gate is None:
            self._to_decode(job, now, handoff)
            return
        self.gate.prefilled(job, now)
        replica = self.gate.decode_replica(job)
        if replica is None:
            self._to_decode(job, now, handoff)
        else:
            engine = replica.engine
            assert isinstance(engine, DecodeEngine)
            engine.send(job, now, handoff)
        self.gate.pump(now)

    def _to_decode(self, job: Job, now: float, delay: float) -> None:
        replica = self._pick("decode")
        if replica is None:
            # Every decode replica is draining or starting: the least loaded draining one still serves.
            candidates = [r for r in self.replicas["decode"] if r.state == "draining"]
            replica = min(candidates, key=lambda r: r.engine.load if isinstance(r.engine, DecodeEngine) else 0)
        engine = replica.engine
        assert isinstance(engine, DecodeEngine)
        engine.send(job, now, delay)

    def _first_token(self, job: Job, now: float) -> None:
        self.observer.router_ttft(job, now - job.arrival)
        if self.gate is not None:
            self.gate.first_chunk(job, now)

    def _finished(self, job: Job, now: float) -> None:
        self.request_done()
        self.observer.router_finished(job)
        if self.gate is not None:
            self.gate.decode_freed(now)

    def request_done(self) -> None:
        """One request fewer to replay (finished, or refused by the router)."""
        self._unfinished -= 1

    # ------------------------------------------------------------------------------------------- replicas

    def _add_replica(self, role: Role, now: float, startup: float) -> Replica:
        name = f"{role}-{next(self._names)}"
        timing = self.config.prefill_timing if role == "prefill" else self.config.decode_timing
        engine: PrefillEngine | DecodeEngine
        if role == "prefill":
            engine = PrefillEngine(timing, self.schedule, self._prefilled)
        else:
            kv = self.config.path.kv_transfer.seconds
            engine = DecodeEngine(
                timing, self.schedule, self._finished, self._first_token, self.observer.router_itl, kv_transfer=kv
            )
        replica = Replica(name, role, engine, now)
        replica.ready_at = now + startup
        self.replicas[role].append(replica)
        if startup <= 0:
            replica.state = "ready"
        else:

            def ready(at: float) -> None:
                if replica.state == "starting":
                    replica.state = "ready"
                    if self.gate is not None:
                        self.gate.pump(at)

            self.schedule(replica.ready_at, ready)
        return replica

    def active(self, role: Role) -> list[Replica]:
        """Replicas that count toward the pool's size (starting or ready, not draining)."""
        return [r for r in self.replicas[role] if r.state in ("starting", "ready")]

    def scale(self, role: Role, desired: int, now: float) -> None:
        """Make the pool `desired` replicas: start new ones, or cancel starting ones then drain the idlest."""
        active = self.active(role)
        if desired > len(active):
            for _ in range(desired - len(active)):
                self._add_replica(role, now, self.config.startup_s)
            return
        surplus = len(active) - desired
        starting = [r for r in active if r.state == "starting"]
        for replica in reversed(starting[:surplus]):
            self._remove(replica, now)
        surplus -= min(surplus, len(starting))
        if surplus:
            ready = sorted(
                (r for r in active if r.state == "ready"),
                key=lambda r: r.engine.outstanding_tokens if isinstance(r.engine, PrefillEngine) else r.engine.load,
            )
            for replica in ready[:surplus]:
                self._drain(replica, now)

    def _drain(self, replica: Replica, now: float) -> None:
        replica.state = "draining"
        if replica.engine.idle:
            self._remove(replica, now)
            return

        def idle(at: float) -> None:
            if replica.state == "draining":
                self._remove(replica, at)

        replica.engine.on_idle = idle

    def _remove(self, replica: Replica, now: float) -> None:
        replica.state = "gone"
        replica.removed_at = now
        self.replicas[replica.role].remove(replica)
        self.gone.append(replica)
        self.observer.forget(replica)

    # ---------------------------------------------------------------------------------------------- ticks

    def _publish(self, now: float, tokens: int) -> None:
        def use(at: float) -> None:
            self.threshold = tokens
            self.thresholds.append((at, tokens))

        delay = self.config.control_delay_s
        if delay > 0:
            self.schedule(now + delay, use)
        else:
            use(now)

    def _schedule_tick(self, at: float) -> None:
        """The tick at `at`, observing `metrics_lag_s` before it (not before time 0)."""
        lag = min(self.config.metrics_lag_s, at)

        def observe(seen_at: float) -> None:
            observation = self.observer.tick(seen_at)
            self.schedule(at, lambda now: self._tick(now, observation))

        if lag > 0:
            self.schedule(at - lag, observe)
        else:
            self.schedule(at, lambda now: self._tick(now, self.observer.tick(now)))

    def _tick(self, now: float, observation: Observation) -> None:
        prefill, decode = self.scaler.tick(observation)
        if isinstance(self.scaler, ThresholdPublisher) and self.scaler.threshold != self._chosen:
            self._chosen = self.scaler.threshold
            self._publish(now, self._chosen)
        for role, wanted in (("prefill", prefill), ("decode", decode)):
            if wanted != len(self.active(role)):  # type: ignore[arg-type]
                self.actions += 1
                self.scale(role, wanted, now)  # type: ignore[arg-type]
        self.timeline.append(
            (
                now,
                len(self.active("prefill")),
                len(self.active("decode")),
                sum(r.state == "ready" for r in self.replicas["prefill"]),
                sum(r.state == "ready" for r in self.replicas["decode"]),
            )
        )
        self._schedule_tick(now + self.config.interval_s)
