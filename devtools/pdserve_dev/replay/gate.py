"""The replayed router's late binding: the product's admission rule over virtual time.

With `spec.router.routing.lateBinding: true` pdserve's router keeps requests in its own queue until an engine of the
pool they need has room (`pdserve_runtime.router.admission`, run by the router's gate). This module runs that very
rule (the same `AdmissionQueue` and `has_room`) for the replay:

- a request joins the queue on arrival (pool "prefill" for a PD request, "decode" for a short prompt or a fallback);
- a dispatch pass binds waiting requests while an engine has room, in the queue's order (fresh before late, then
  fair start tags): a PD request takes a prefill engine with room for its prompt and reserves a sequence on a
  decode engine with one free (as the gate's plan pairs them), a decode request a decode engine with a free
  sequence; among those with room the least loaded, as the replay's router without late binding picks;
- a pass runs on every event that can make room: an arrival, a prefill finishing, a request finishing on decode,
  a replica becoming ready, and the next shed deadline;
- a request that waited `max_wait_s` is shed (503, a miss); so is one refused by a full queue.

What it leaves out: one router replica (the budget is not shared) and one client (the trace names none, so the fair
queue is first come first served within each lateness class). The path estimate behind lateness is the
product's (`admission.PathEstimate`), learned the same way from the replay's prefills and first chunks. (It was the
cost model's idle-engine time for the prompt: under a burst it left out the wait behind a busy engine and a loaded
decode step, so the queue took requests with too little slack to make their deadlines; issue 19's synthetic trace
read 92.91% where the product's rule makes 96.73%.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve_dev.replay.engines import DecodeEngine, Job, PrefillEngine
from pdserve_runtime.router.admission import (
    AdmissionQueue,
    Budget,
    EngineLoad,
    PathEstimate,
    Pool,
    QueueConfig,
    Ticket,
    has_room,
)
from pdserve_sim.presets import TimingParams

if TYPE_CHECKING:
    from pdserve_dev.replay.cluster import ReplayCluster, Replica

#: The trace names no clients: every request is this one's.
CLIENT = "trace"


@dataclass(frozen=True, slots=True)
class LateBinding:
    """The router's admission settings for the replay (`pdserve.api.router_config.AdmissionConfig`'s)."""

    #: Uncached prompt tokens one prefill engine may hold (the operator renders 1.5 x maxNumBatchedTokens).
    prefill_tokens: int
    #: Sequences one decode engine may run (the operator renders the spec's decode maxNumSeqs).
    decode_sequences: int
    max_wait_s: float = 15.0
    max_queued: int = 2048

    @classmethod
    def rendered(cls, prefill: TimingParams, decode: TimingParams) -> LateBinding:
        """The budgets the operator renders for engines with these limits (`render.router.admission`)."""
        return cls(prefill.max_num_batched_tokens * 3 // 2, decode.max_num_seqs)


class ReplayGate:
    """The router's queue and dispatch passes for one replay (module docstring)."""

    def __init__(self, settings: LateBinding, cluster: ReplayCluster) -> None:
        self.cluster = cluster
        config = cluster.config
        self.budget = Budget(settings.prefill_tokens, settings.decode_sequences)
        #: What a dispatched request's path costs, learned from the replay's prefills and first chunks as the
        #: router's gate learns it from the engines' answers.
        self.path = PathEstimate()
        self.queue: AdmissionQueue[Job] = AdmissionQueue(
            QueueConfig(settings.max_queued, settings.max_wait_s, ttft_target_s=config.slo.ttft_s),
            service_s=lambda ticket: self.path.seconds(ticket.pool, ticket.tokens),
        )
        #: Decode sequences reserved by PD requests still prefilling, per decode replica, and whose they are.
        self._reserved: dict[str, int] = {}
        self._bound: dict[Job, Replica] = {}
        self._expiry_at: float | None = None
        #: A waiting request found no decode engine with a free sequence: a request leaving decode may unblock it.
        self._decode_blocked = False
        #: Requests refused or shed (misses that never reached an engine).
        self.shed = 0

    # -- the router's side ---------------------------------------------------------------------------------------

    def arrive(self, job: Job, pool: Pool, now: float) -> None:
        """Queue a request that just arrived, then dispatch what has room."""
        pushed = self.queue.push(job, client=CLIENT, pool=pool, tokens=job.prompt, now=now)
        for _victim in pushed.pushed_out:
            self._drop()
        if pushed.ticket is None:
            self._drop()
        self.pump(now)

    def pump(self, now: float) -> None:
        """One dispatch pass: shed what expired, then bind heads while an engine has room."""
        queue = self.queue
        if not len(queue):
            return
        for _expired in queue.expire(now):
            self._drop()
        while True:
            for ticket in queue.candidates(now):
                if self._bind(ticket, now):
                    break
            else:
                break
        self._arm(now)

    def decode_freed(self, now: float) -> None:
        """A request left a decode engine: a pass, if a waiting request lacked a decode sequence (a pass per
        finished request otherwise costs the replay most of its time for nothing)."""
        if self._decode_blocked:
            self._decode_blocked = False
            self.pump(now)

    def decode_replica(self, job: Job) -> Replica | None:
        """The decode replica a PD request reserved when it was bound (None: none, or it is gone)."""
        replica = self._bound.pop(job, None)
        if replica is None:
            return None
        self._reserved[replica.name] -= 1
        return replica if replica.state != "gone" else None

    def prefilled(self, job: Job, now: float) -> None:
        """A PD request's prefill answered: the router times it from dispatch (`Gate.observe_prefill`)."""
        self.path.prefill(job.prompt, now - job.dispatched)

    def first_chunk(self, job: Job, now: float) -> None:
        """Decode's first chunk: timed from the request's send to decode (after prefill on the PD route)."""
        sent = job.prefill_done if job.route == "pd" else job.dispatched
        self.path.first_chunk(now - sent)

    def waiting(self, pool: Pool) -> int:
        return self.queue.waiting(pool)

    def waiting_tokens(self, pool: Pool) -> int:
        return self.queue.waiting_tokens(pool)

    # -- inside --------------------------------------------------------------------------------------------------

    def _bind(self, ticket: Ticket[Job], now: float) -> bool:
        job = ticket.item
        decode = self._room_on_decode()
        if decode is None:
            self._decode_blocked = True
            return False
        if ticket.pool == "decode" or not any(r.state == "ready" for r in self.cluster.replicas["prefill"]):
            if ticket.pool == "prefill":
                # No prefill engine serves any more: the request falls back to decode, as the router's plan would.
                job.route = "fallback"
            self._take(ticket, now)
            engine = decode.engine
            assert isinstance(engine, DecodeEngine)
            engine.send(job, now, self.cluster.config.path.dispatch_s(job.route, job.prompt))
            return True
        prefill = self._room_on_prefill(ticket.tokens)
        if prefill is None:
            return False
        self._take(ticket, now)
        self._bound[job] = decode
        self._reserved[decode.name] = self._reserved.get(decode.name, 0) + 1
        engine = prefill.engine
        assert isinstance(engine, PrefillEngine)
        engine.send(job, now, self.cluster.config.path.dispatch_s("pd", job.prompt))
        return True

    def _room_on_prefill(self, tokens: int) -> Replica | None:
        """The least loaded ready prefill replica, if it has room: with one router replica the rule only compares
        an engine's tokens with the budget, so no other engine has room when the least loaded has none."""
        best: Replica | None = None
        engine: PrefillEngine | None = None
        for replica in self.cluster.replicas["prefill"]:
            candidate = replica.engine
            if (
                replica.state == "ready"
                and isinstance(candidate, PrefillEngine)
                and (engine is None or candidate.outstanding_tokens < engine.outstanding_tokens)
            ):
                best, engine = replica, candidate
        if best is None or engine is None:
            return None
        load = EngineLoad(len(engine.waiting) + len(engine.running) + engine.in_transit, engine.outstanding_tokens)
        return best if has_room("prefill", load, cost=tokens, budget=self.budget, replicas=1) else None

    def _room_on_decode(self) -> Replica | None:
        """The least loaded ready decode replica (its requests and reservations), if it has a free sequence."""
        best: Replica | None = None
        best_load = 0
        for replica in self.cluster.replicas["decode"]:
            if replica.state != "ready":
                continue
            load = self._decode_load(replica)
            if best is None or load < best_load:
                best, best_load = replica, load
        if best is None:
            return None
        return best if has_room("decode", EngineLoad(best_load), cost=0, budget=self.budget, replicas=1) else None

    def _decode_load(self, replica: Replica) -> int:
        engine = replica.engine
        held = engine.load if isinstance(engine, DecodeEngine) else 0
        return held + self._reserved.get(replica.name, 0)

    def _take(self, ticket: Ticket[Job], now: float) -> None:
        self.queue.take(ticket, now)
        ticket.item.dispatched = now
        self.cluster.jobs.append(ticket.item)

    def _drop(self) -> None:
        """A request the router answered 429/503 without an engine: a miss, and one request fewer to wait for."""
        self.shed += 1
        self.cluster.request_done()

    def _arm(self, now: float) -> None:
        """Make sure a pass runs at the next shed deadline."""
        expiry = self.queue.next_expiry()
        if expiry is None or (self._expiry_at is not None and now <= self._expiry_at <= expiry):
            return
        self._expiry_at = expiry

        def expire(at: float) -> None:
            if self._expiry_at == expiry:
                self._expiry_at = None
            self.pump(at)

        self.cluster.schedule(expiry, expire)
