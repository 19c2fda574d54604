"""The admission gate: requests wait here, not in an engine's queue, until an engine has room (issue 19).

`admission` is the rule (pure); this module runs it on the event loop against the live endpoint table:

- `Gate.admit` is called once per request after the plan (`Scheduler.plan` chose the route and the engines it
  would use). With nothing waiting and room on the planned engines, the request is bound to them at once (the
  fast path: two room checks). Otherwise it joins the queue and awaits its turn.
- A dispatch pass (`Gate.dispatch`) binds waiting requests while some engine has room: each pool's head in the
  queue's order is re-planned over the engines that have room now (a PD request: a prefill engine with room for
  its uncached tokens, paired with a decode engine with a free sequence; a decode-only request: a decode engine
  with one), so a request goes to whichever engine frees first, not to the one it was first planned for. A pass
  runs synchronously on every event that can make room: a request leaving an engine, an engine joining or coming
  back (the endpoint table's listeners), a fresh engine metrics read, a change of the router replica count; a
  timer runs it for the next shed deadline, and at least every `BACKSTOP_SECONDS` while anything waits.
- A binding reserves what it takes (`EndpointState.reserved`, `reserved_tokens`) until the request's lease on that
  engine starts (`Binding.started`) or the request ends (`Binding.release`), so no two passes can give the same
  room away twice.

Who a client is (for fair queueing, `client_key`): the value of `clientHeader` when configured (a header a
trusted proxy sets), else the Authorization header (hashed: the key is never kept), else the peer address.
Behind a proxy that passes Authorization through, clients are API keys; anonymous requests behind a proxy all
share the proxy's address (set `clientHeader` there).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from time import monotonic

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.api.router_config import AdmissionConfig
from pdserve_runtime.router.admission import (
    POOLS,
    SHED_REASONS,
    AdmissionQueue,
    Budget,
    EngineLoad,
    PathEstimate,
    Pool,
    QueueConfig,
    Shed,
    Ticket,
    has_room,
)
from pdserve_runtime.router.endpoints import EndpointState, EndpointTable
from pdserve_runtime.router.metrics import HistogramFamily
from pdserve_runtime.router.policy.decision import Route
from pdserve_runtime.router.policy.scheduler import Plan, Scheduler
from pdserve_runtime.router.tokens import Held, PromptInfo

log = logging.getLogger("pdserve.router")

# Engine-reported load older than this is ignored (as the KV-usage score ignores old readings).
REPORT_STALE_SECONDS = 10.0
# While anything waits, a pass runs at least this often: a safety net under the event-driven passes (a room that
# opened without an event the gate hears of, e.g. an engine-reported load going stale).
BACKSTOP_SECONDS = 1.0
# Weight of the newest observation in the moving averages of the path estimate and the mean prompt.
_EWMA = 0.1
_SHUTDOWN = "the router is shutting down; retry (another router replica serves it)"
QUEUE_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0)


def client_key(headers: Mapping[str, str], address: str, header: str | None) -> str:
    """Who sent a request, for fair queueing (module docstring). Secrets are hashed, never kept."""
    if header is not None:
        value = headers.get(header.lower())
        if value:
            return "h:" + hashlib.sha256(value.encode()).hexdigest()[:24]
    authorization = headers.get("authorization")
    if authorization:
        return "k:" + hashlib.sha256(authorization.encode()).hexdigest()[:24]
    return "a:" + address


@dataclass(slots=True)
class Binding:
    """The engines a request may use now, and the room it holds on them until it starts there."""

    route: Route
    decode: EndpointState
    prefill: EndpointState | None
    tokens: int
    _held: list[tuple[EndpointState, int]] = field(default_factory=list)
    _released: Callable[[], None] | None = None

    def hold(self, state: EndpointState, tokens: int) -> None:
        state.reserved += 1
        state.reserved_tokens += tokens
        self._held.append((state, tokens))

    def started(self, state: EndpointState) -> None:
        """The request's lease on `state` began: it counts there now, not as a reservation. The reservation given
        back is the one of `state`'s pool, whichever engine it was on: a retry on another engine of the pool ends
        the need for the first one's room too."""
        role = state.endpoint.role
        for index, (held, tokens) in enumerate(self._held):
            if held.endpoint.role == role:
                del self._held[index]
                held.reserved -= 1
                held.reserved_tokens -= tokens
                return

    def release(self) -> None:
        """Give back whatever is still reserved (the request ended, or took another path)."""
        if not self._held:
            return
        for state, tokens in self._held:
            state.reserved -= 1
            state.reserved_tokens -= tokens
        self._held.clear()
        if self._released is not None:
            self._released()


@dataclass(slots=True)
class _Want:
    """What a waiting request needs, and where its answer goes."""

    prompt: PromptInfo
    route: Route
    tokens: int
    future: asyncio.Future[Binding | Shed]


class Gate:
    """The router's queue and its dispatch passes (module docstring)."""

    def __init__(
        self,
        config: AdmissionConfig,
        table: EndpointTable,
        scheduler: Scheduler,
        registry: CollectorRegistry,
        *,
        fallback_to_decode: bool,
        retry_after_s: int,
        clock: Callable[[], float] = monotonic,
    ) -> None:
        self.config = config
        self.table = table
        self.scheduler = scheduler
        self.budget = Budget(config.prefill_budget_tokens, config.decode_budget_sequences)
        self.fallback_to_decode = fallback_to_decode
        self.clock = clock
        self.path = PathEstimate()
        self.queue: AdmissionQueue[_Want] = AdmissionQueue(
            QueueConfig(
                max_queued=config.max_queued_requests,
                max_wait_s=config.max_queue_seconds,
                ttft_target_s=config.ttft_target_seconds,
                retry_after_s=retry_after_s,
            ),
            service_s=lambda ticket: self.path.seconds(ticket.pool, ticket.tokens),
        )
        self._replicas = config.router_replicas
        self._mean_tokens = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._closed = False
        table.listeners.append(self.dispatch)
        self.arrived = Counter(
            "pdserve_router_arrived_requests",
            "Requests entering a pool's path (pool: the one a request waits for), counted at arrival, queued or not.",
            ["pool"],
            registry=registry,
        )
        self.arrived_tokens = Counter(
            "pdserve_router_arrived_prompt_tokens",
            "Uncached prompt tokens of the requests entering a pool's path, counted at arrival.",
            ["pool"],
            registry=registry,
        )
        self.shed = Counter(
            "pdserve_router_shed",
            "Requests answered 429/503 by the admission rule, by reason (deadline, queue_full, client_share, "
            "shutdown).",
            ["pool", "reason"],
            registry=registry,
        )
        self.wait = HistogramFamily(
            "pdserve_router_queue_wait_seconds",
            "Time from a request's arrival to its dispatch to an engine (0 when an engine had room at once).",
            ["pool"],
            QUEUE_WAIT_BUCKETS,
        )
        registry.register(self.wait)
        registry.register(_QueueCollector(self))
        self._arrived = {pool: (self.arrived.labels(pool), self.arrived_tokens.labels(pool)) for pool in POOLS}
        self._waits = {pool: self.wait.labels(pool) for pool in POOLS}
        for pool in POOLS:
            for reason in SHED_REASONS:
                self.shed.labels(pool, reason)  # every series from 0, so the first shed shows in rate()

    # -- the replica count --------------------------------------------------------------------------------------

    @property
    def replicas(self) -> int:
        """Router replicas sharing every engine's budget (N: each replica takes budget / N)."""
        return self._replicas

    @replicas.setter
    def replicas(self, count: int) -> None:
        count = max(1, count)
        if count != self._replicas:
            log.info("Updated router replicas before=%d after=%d", self._replicas, count)
            self._replicas = count
            self.dispatch()

    # -- the TTFT target ----------------------------------------------------------------------------------------

    @property
    def ttft_target_s(self) -> float | None:
        """The TTFT target that gives each new request its deadline (None: no deadline order)."""
        return self.queue.config.ttft_target_s

    @ttft_target_s.setter
    def ttft_target_s(self, seconds: float | None) -> None:
        # Published by the operator (`control.Controls`) and changed while requests wait: those keep their deadline.
        self.queue.config = replace(self.queue.config, ttft_target_s=seconds)

    # -- admitting ----------------------------------------------------------------------------------------------

    async def admit(self, plan: Plan, prompt: PromptInfo, client: str) -> Binding | Shed:
        """Bind a planned request to engines with room, now or once it is its turn; or say why not (`Shed`)."""
        assert plan.decode is not None
        pool: Pool = "prefill" if plan.route is Route.PD else "decode"
        tokens = plan.uncached_tokens
        requests, prompt_tokens = self._arrived[pool]
        requests.inc()
        prompt_tokens.inc(tokens)
        if self._closed:
            self.shed.labels(pool, "shutdown").inc()
            return Shed(503, "shutdown", _SHUTDOWN, self.queue.config.retry_after_s)
        if not len(self.queue):
            binding = self._bind_planned(plan)
            if binding is not None:
                self.queue.admitted(client, tokens)
                self._waits[pool].observe(0.0)
                return binding
        want = _Want(prompt, plan.route, tokens, asyncio.get_running_loop().create_future())
        pushed = self.queue.push(want, client=client, pool=pool, tokens=tokens, now=self.clock())
        for victim in pushed.pushed_out:
            self._answer_shed(victim)
        if pushed.refused is not None:
            self.shed.labels(pool, pushed.refused.reason).inc()
            return pushed.refused
        ticket = pushed.ticket
        assert ticket is not None
        self.dispatch()
        try:
            return await want.future
        except asyncio.CancelledError:
            self.queue.remove(ticket)
            if want.future.done() and not want.future.cancelled():
                found = want.future.result()
                if isinstance(found, Binding):
                    found.release()
            raise

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill answered in `seconds` (the path estimate behind lateness)."""
        self.path.prefill(tokens, seconds)

    def observe_first_chunk(self, seconds: float) -> None:
        """A decode engine's first chunk came `seconds` after the request was sent."""
        self.path.first_chunk(seconds)

    def close(self) -> None:
        """Shutdown: every waiting request is told (503, `shutdown`), and later arrivals too."""
        self._closed = True
        for ticket in self.queue.drain(self.clock()):
            self._answer_shed(ticket)
        self._cancel_timer()

    # -- dispatching --------------------------------------------------------------------------------------------

    def dispatch(self) -> None:
        """One pass: shed what waited too long, then bind heads while an engine has room (module docstring)."""
        queue = self.queue
        if not len(queue):
            return
        now = self.clock()
        for ticket in queue.expire(now):
            self._answer_shed(ticket)
        progress = True
        while progress and len(queue):
            progress = False
            for ticket in queue.candidates(now):
                want = ticket.item
                if want.future.done():  # its client left; the handler removes it as it unwinds
                    queue.remove(ticket)
                    progress = True
                    break
                binding = self._bind(want)
                if binding is None:
                    continue
                queue.take(ticket, now)
                self._waits[ticket.pool].observe(now - ticket.arrival)
                want.future.set_result(binding)
                progress = True
                break
        self._arm_timer(now)

    def _answer_shed(self, ticket: Ticket[_Want]) -> None:
        assert ticket.shed is not None
        self.shed.labels(ticket.pool, ticket.shed.reason).inc()
        future = ticket.item.future
        if not future.done():
            future.set_result(ticket.shed)
        log.info("Shed request pool=%s reason=%s waited=%.3fs", ticket.pool, ticket.shed.reason,
                 self.clock() - ticket.arrival)  # fmt: skip

    def _arm_timer(self, now: float) -> None:
        """Run a pass at the next shed deadline, or within BACKSTOP_SECONDS, while anything waits."""
        expiry = self.queue.next_expiry()
        if expiry is None:
            self._cancel_timer()
            return
        at = min(expiry, now + BACKSTOP_SECONDS)
        if self._timer is not None and self._timer_at <= at:
            return
        self._cancel_timer()
        self._timer_at = at
        self._timer = asyncio.get_running_loop().call_later(max(0.0, at - now), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = math.inf
        self.dispatch()
        if len(self.queue) and self._timer is None:
            self._arm_timer(self.clock())

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._timer_at = math.inf

    # -- room -----------------------------------------------------------------------------------------------------

    def load(self, state: EndpointState, now: float) -> EngineLoad:
        """What this replica knows of an engine's load (`admission.EngineLoad`)."""
        others = 0
        if state.reported_requests is not None and now - state.reported_at <= REPORT_STALE_SECONDS:
            others = max(0, state.reported_requests - state.own_at_report)
        return EngineLoad(
            requests=state.in_flight + state.reserved,
            tokens=state.in_flight_tokens + state.reserved_tokens,
            others=others,
        )

    def has_room(self, state: EndpointState, pool: Pool, tokens: int, now: float) -> bool:
        if not self.budget.of(pool):
            return True
        return has_room(
            pool,
            self.load(state, now),
            cost=tokens,
            budget=self.budget,
            replicas=self._replicas,
            mean_tokens=self._mean_tokens,
        )

    def _bind_planned(self, plan: Plan) -> Binding | None:
        """The fast path: the plan's own engines, when they have room."""
        decode, prefill = plan.decode, plan.prefill
        assert decode is not None
        now = self.clock()
        if not self.has_room(decode, "decode", 0, now):
            return None
        if prefill is not None and not self.has_room(prefill, "prefill", plan.uncached_tokens, now):
            return None
        return self._hold(plan.route, decode, prefill, plan.uncached_tokens)

    def _bind(self, want: _Want) -> Binding | None:
        """Engines with room for a waiting request now, chosen by the scheduler's profiles among them."""
        now = self.clock()
        held: Mapping[str, Held] = self.scheduler.held_by(want.prompt, now)
        decodes = [state for state in self.table.usable("decode") if self.has_room(state, "decode", 0, now)]
        if not decodes:
            return None
        route = want.route
        if route is Route.PD:
            usable = self.table.usable("prefill")
            if not usable and self.fallback_to_decode:
                route = Route.FALLBACK  # the prefill pool is gone while the request waited: decode prefills it
            else:
                prefills = [state for state in usable if self.has_room(state, "prefill", want.tokens, now)]
                compat = {state.endpoint.kv_compat for state in prefills}
                pairable = [state for state in decodes if state.endpoint.kv_compat in compat]
                decode = self.scheduler.pick_decode(want.prompt, held, candidates=pairable) if pairable else None
                if decode is None:
                    return None
                prefill = self.scheduler.pick_prefill(want.prompt, held, decode, candidates=prefills)
                if prefill is None:
                    return None
                return self._hold(route, decode, prefill, want.tokens)
        decode = self.scheduler.pick_decode(want.prompt, held, candidates=decodes)
        return self._hold(route, decode, None, want.tokens) if decode is not None else None

    def _hold(self, route: Route, decode: EndpointState, prefill: EndpointState | None, tokens: int) -> Binding:
        binding = Binding(route, decode, prefill, tokens, _released=self.dispatch)
        binding.hold(decode, 0)
        if prefill is not None:
            binding.hold(prefill, tokens)
            self._mean_tokens += _EWMA * (tokens - self._mean_tokens) if self._mean_tokens else tokens
        return binding


class _QueueCollector(Collector):
    """The queue's gauges, read at scrape time."""

    def __init__(self, gate: Gate) -> None:
        self._gate = gate

    def collect(self) -> Iterator[Metric]:
        gate = self._gate
        requests = GaugeMetricFamily(
            "pdserve_router_queue_requests",
            "Requests waiting in this router replica for an engine of the pool.",
            labels=["pool"],
        )
        tokens = GaugeMetricFamily(
            "pdserve_router_queue_prompt_tokens",
            "Uncached prompt tokens of the requests waiting for an engine of the pool.",
            labels=["pool"],
        )
        for pool in POOLS:
            requests.add_metric([pool], gate.queue.waiting(pool))
            tokens.add_metric([pool], gate.queue.waiting_tokens(pool))
        yield requests
        yield tokens
        yield GaugeMetricFamily(
            "pdserve_router_replicas", "Router replicas sharing every engine's budget (this one included).",
            value=gate.replicas,
        )  # fmt: skip
