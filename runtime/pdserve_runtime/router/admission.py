"""The admission rule: late binding, one bounded queue fair across clients, deadline order, shedding. Pure.

No IO and no clock of its own (every method takes `now`): the router's gate (`gate.py`) runs it on the event loop
and the replay model (`pdserve_dev.replay`) runs the same code over simulated time, so the benchmark measures the
rule the product runs.

**Late binding.** A request waits in the router until an engine of the pool it needs has room, and is bound to an
engine only then: a replica that becomes Ready takes waiting work at once, and a slow engine holds at most its
budget. `has_room` is the rule:

- prefill: uncached prompt tokens (queued or running at the engine, as this router counts them) plus the new
  prompt stay within the replica's allowance of `Budget.prefill_tokens`. A prompt larger than the allowance goes
  alone (to an engine this replica has nothing on), so no prompt waits forever;
- decode: running sequences (plus those reserved by requests whose prefill runs now) stay within the allowance of
  `Budget.decode_sequences`;
- a budget of 0 is unbounded (no late binding for that pool).

**Several router replicas** share each engine's budget without talking to each other: each takes `budget / N`
(floor; at least one sequence), N the ready router replicas it sees. The engine's own report (running + waiting
requests, from its /metrics) corrects it: requests beyond this replica's own are someone else's (another replica
whose N is stale, a client going around the router), and the allowance shrinks to what the budget leaves them:
`min(budget / N, budget - others)`, tokens counted at the pool's mean uncached prompt.

**The queue** holds every waiting request of both pools (bounded by `max_queued`). Order:

1. fresh before late: a request is late once it can no longer meet its deadline (arrival + the TTFT target) even
   if dispatched now (`service_s`, the path it still has: prefill, the KV handoff, decode's first step). Serving
   requests that can still make it first means a burst beyond capacity makes its excess late, instead of making
   every request behind it late (first come first served does that). Without a TTFT target nothing is late;
2. within each class, start-time fair queueing across clients (Goyal et al., SFQ): a request's start tag is
   max(virtual time, its client's last finish tag), its finish tag that plus its cost (uncached prompt tokens, at
   least 1), and the smallest start tag goes first; the virtual time is the start tag of the last request taken.
   A client that sends 500 requests at once has tags far ahead of one that sends one now, so the newcomer is next,
   and each client gets the engines in proportion to its share of tokens, however many requests it queued.
   Lateness is checked on the head of each pool only (a request is checked when it comes to the front).

Each pool's head is tried in that order; a head that fits no engine waits (and holds back the rest of its pool, so
long prompts are never starved by short ones), while the other pool's head may still go.

**Shedding** happens only when a request can no longer meet any useful deadline, and always says why (`Shed`):

- `deadline` (503): it waited `max_wait_s` (the longest a client will usefully wait for a first token; below the
  router's first-byte timeout) without an engine having room;
- `queue_full` (429): the queue is full and this client already holds its fair share of it (max_queued divided by
  the clients waiting, itself included);
- `client_share` (429): the queue is full and another client, within its share, needed the place: the newest
  request of the client holding the most is pushed out (so a burst never locks others out of the queue);
- `shutdown` (503): the router is stopping (another replica serves the retry).

`Retry-After` is the time the pool needs to dispatch what is queued at its recent dispatch rate, at least
`retry_after_s`, at most 60 s.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

Pool = Literal["prefill", "decode"]
POOLS: tuple[Pool, ...] = ("prefill", "decode")
ShedReason = Literal["deadline", "queue_full", "client_share", "shutdown"]
SHED_REASONS: tuple[ShedReason, ...] = ("deadline", "queue_full", "client_share", "shutdown")

T = TypeVar("T")

# Longest Retry-After the rule sends (a client told to wait longer would rather go elsewhere).
MAX_RETRY_AFTER_S = 60
# Time constant of the dispatch rate estimate behind Retry-After.
RATE_WINDOW_S = 10.0
# Weight of the newest observation in the path estimate's moving averages.
PATH_EWMA = 0.1


# --------------------------------------------------------------------------------------------- engine budgets


@dataclass(frozen=True, slots=True)
class Budget:
    """What one engine may hold across every router replica (0: unbounded)."""

    #: Uncached prompt tokens queued or running at one prefill engine (e.g. two steps of max_num_batched_tokens:
    #: one running, one ready, so the engine never idles between steps and nothing more waits there).
    prefill_tokens: int = 0
    #: Sequences running at one decode engine (its max_num_seqs).
    decode_sequences: int = 0

    def of(self, pool: Pool) -> int:
        return self.prefill_tokens if pool == "prefill" else self.decode_sequences


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What one router replica knows of one engine's load."""

    #: Requests this replica has on the engine (in flight, or bound and about to be sent).
    requests: int
    #: Their uncached prompt tokens (prefill engines).
    tokens: int = 0
    #: Requests the engine reports beyond this replica's own (0 when the report is missing or stale).
    others: int = 0


def share(budget: int, replicas: int, pool: Pool) -> int:
    """One replica's part of an engine's budget: budget / replicas, rounded down (a decode budget below the
    replica count still lets each replica run one sequence)."""
    part = budget // max(1, replicas)
    return max(1, part) if pool == "decode" else part


def allowance(budget: int, replicas: int, pool: Pool, others_cost: float) -> float:
    """What this replica may put on the engine: its share, less what others hold beyond their own shares."""
    return min(share(budget, replicas, pool), budget - others_cost)


def has_room(
    pool: Pool, load: EngineLoad, *, cost: int, budget: Budget, replicas: int, mean_tokens: float = 0.0
) -> bool:
    """Whether this replica may bind one more request of `cost` (uncached prompt tokens; decode: ignored) to an
    engine of `pool` carrying `load`. `mean_tokens`: the pool's mean uncached prompt, to weigh `load.others`."""
    limit = budget.of(pool)
    if limit <= 0:
        return True
    if pool == "decode":
        return load.requests + 1 <= allowance(limit, replicas, pool, load.others)
    allowed = allowance(limit, replicas, pool, load.others * mean_tokens)
    if load.requests == 0:
        return allowed > 0  # a prompt larger than the allowance goes alone
    return load.tokens + cost <= allowed


# ------------------------------------------------------------------------------------------------- the queue


@dataclass(slots=True)
class PathEstimate:
    """What a dispatched request's path still costs, learned from the engines' answers (for lateness,
    `AdmissionQueue._head`: a request is late once its deadline is nearer than this).

    Prefill: seconds from dispatch to the prefill's answer as a line in the uncached prompt tokens, fitted by least
    squares over exponentially weighted moments. The intercept is what every prompt pays whatever its length (the
    wait behind what the engine already holds, up to its budget: about a full step once engines are busy, and the
    step's fixed cost); the slope is compute per token. One ratio of seconds per token charged that wait to every
    token: short prompts, which wait as long as long ones, taught a large ratio, and a long prompt was judged
    unable to make a deadline it could make. On top comes the fit's mean absolute error, so a request is judged by
    a path most requests make rather than the mean, which half of them miss: a request taken with only the mean's
    slack left reaches its first token just too late, and under a burst beyond capacity every request the queue
    takes has only that slack (issue 19's synthetic trace: 96.03% attainment with the line alone, 96.73% with
    the error; 92.91% with the idle-engine path the replay charged before). Decode: the seconds from the send to
    decode to its first chunk (the KV pull and a loaded step).
    """

    decode_first: float = 0.0
    #: Moving means of tokens, seconds, tokens^2 and tokens x seconds of the prefills seen, and how many.
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0
    _prefills: int = 0
    #: Moving mean absolute error of the line, each prefill judged by the line before it.
    _error: float = 0.0

    def prefill(self, tokens: int, seconds: float) -> None:
        """A prefill of `tokens` uncached tokens answered `seconds` after dispatch."""
        if tokens <= 0 or seconds < 0:
            return
        if self._prefills:
            fixed, per_token = self.prefill_line()
            self._error += PATH_EWMA * (abs(seconds - fixed - per_token * tokens) - self._error)
        weight = PATH_EWMA if self._prefills else 1.0
        self._prefills += 1
        self._x += weight * (tokens - self._x)
        self._y += weight * (seconds - self._y)
        self._xx += weight * (tokens * tokens - self._xx)
        self._xy += weight * (tokens * seconds - self._xy)

    def first_chunk(self, seconds: float) -> None:
        """Decode's first chunk came `seconds` after the request was sent there."""
        self.decode_first += PATH_EWMA * (seconds - self.decode_first)

    def prefill_line(self) -> tuple[float, float]:
        """(seconds every prompt pays, seconds per uncached token). Lengths too alike to tell the two apart, or a
        line sloping down, read as all fixed cost; a negative intercept as all per-token cost."""
        if self._prefills == 0:
            return 0.0, 0.0
        variance = self._xx - self._x * self._x
        if variance <= (0.05 * self._x) ** 2:
            return self._y, 0.0
        slope = (self._xy - self._x * self._y) / variance
        if slope <= 0:
            return self._y, 0.0
        intercept = self._y - slope * self._x
        if intercept < 0:
            return 0.0, self._y / self._x
        return intercept, slope

    def seconds(self, pool: Pool, tokens: int) -> float:
        """The path a request of `pool` with `tokens` uncached prompt tokens still has once dispatched."""
        if pool != "prefill":
            return self.decode_first
        fixed, per_token = self.prefill_line()
        return fixed + per_token * tokens + self._error + self.decode_first


@dataclass(frozen=True, slots=True)
class Shed:
    """A refusal: the status, why (a `ShedReason`), what to tell the client, and when to come back."""

    status: int
    reason: ShedReason
    message: str
    retry_after: int


@dataclass(eq=False, slots=True)
class Ticket(Generic[T]):
    """One waiting request. `item` is the caller's (the router's flow, the replay's job)."""

    item: T
    client: str
    pool: Pool
    tokens: int  # uncached prompt tokens (the queue gauges)
    cost: int  # fairness cost: tokens, at least 1
    arrival: float
    deadline: float | None  # arrival + the TTFT target (None: no target, never late)
    expires: float  # arrival + max_wait_s: shed then
    seq: int
    start: float = 0.0  # SFQ start tag
    late: bool = False
    state: Literal["queued", "taken", "shed", "removed"] = "queued"
    #: When it was shed: why, for the caller to answer with.
    shed: Shed | None = None


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """The queue's settings."""

    #: Requests waiting at once (both pools); beyond, `queue_full` / `client_share`.
    max_queued: int
    #: Longest wait for an engine before a request is shed (`deadline`).
    max_wait_s: float
    #: The TTFT target that gives each request its deadline (None: no deadline order).
    ttft_target_s: float | None = None
    #: Smallest Retry-After sent.
    retry_after_s: int = 1


@dataclass(frozen=True, slots=True)
class Pushed(Generic[T]):
    """What `push` did: the ticket queued (or None when refused), the refusal, and requests pushed out for it."""

    ticket: Ticket[T] | None
    refused: Shed | None = None
    pushed_out: tuple[Ticket[T], ...] = ()


@dataclass(slots=True)
class _Client(Generic[T]):
    finish: float = 0.0  # SFQ finish tag of its last request
    tickets: deque[Ticket[T]] = field(default_factory=deque)  # its queued tickets, oldest first (lazy)
    queued: int = 0


@dataclass(slots=True)
class _PoolQueue(Generic[T]):
    fresh: list[tuple[float, int, Ticket[T]]] = field(default_factory=list)  # heap by (start, seq)
    late: list[tuple[float, int, Ticket[T]]] = field(default_factory=list)
    requests: int = 0
    tokens: int = 0
    # Dispatch rate (requests per second, exponentially decayed over RATE_WINDOW_S) and when it was last updated.
    rate: float = 0.0
    rate_at: float = 0.0


class AdmissionQueue(Generic[T]):
    """The router's waiting requests (module docstring): push, try the heads in order, take, expire, remove.

    `service_s(ticket)`: the seconds the request's path still needs once dispatched (for lateness).
    """

    def __init__(self, config: QueueConfig, service_s: Callable[[Ticket[T]], float] | None = None) -> None:
        self.config = config
        self._service_s: Callable[[Ticket[T]], float] = service_s or (lambda _ticket: 0.0)
        self._pools: dict[Pool, _PoolQueue[T]] = {pool: _PoolQueue() for pool in POOLS}
        self._clients: dict[str, _Client[T]] = {}
        self._arrivals: deque[Ticket[T]] = deque()  # every queued ticket in arrival order (lazy): expiry
        self._virtual = 0.0
        self._max_finish = 0.0  # the largest finish tag given: the virtual time once the queue empties
        self._seq = 0
        self._size = 0
        self._until_sweep = 0  # requests leaving before the idle clients may be swept again

    # -- reading ----------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._size

    def waiting(self, pool: Pool) -> int:
        """Requests waiting for an engine of `pool`."""
        return self._pools[pool].requests

    def waiting_tokens(self, pool: Pool) -> int:
        """Their uncached prompt tokens."""
        return self._pools[pool].tokens

    def clients(self) -> int:
        """Clients with a request waiting."""
        return sum(1 for client in self._clients.values() if client.queued)

    def queued_by(self, client: str) -> int:
        found = self._clients.get(client)
        return found.queued if found is not None else 0

    def next_expiry(self) -> float | None:
        """When the oldest waiting request is shed (None: nothing waits)."""
        self._drop_dead_arrivals()
        return self._arrivals[0].expires if self._arrivals else None

    def retry_after(self, pool: Pool, now: float) -> int:
        """Seconds until what waits for `pool` is likely dispatched (the Retry-After of a refusal)."""
        queue = self._pools[pool]
        rate = queue.rate * math.exp(-(now - queue.rate_at) / RATE_WINDOW_S) if queue.rate else 0.0
        floor = self.config.retry_after_s
        if queue.requests == 0:
            return floor
        if rate <= 0:
            return max(floor, min(MAX_RETRY_AFTER_S, math.ceil(self.config.max_wait_s)))
        return max(floor, min(MAX_RETRY_AFTER_S, math.ceil(queue.requests / rate)))

    # -- entering ---------------------------------------------------------------------------------------------

    def push(self, item: T, *, client: str, pool: Pool, tokens: int, now: float) -> Pushed[T]:
        """Queue a request, or refuse it when the queue is full and its client holds its share (`queue_full`);
        when full and within its share, the newest request of the client holding the most gives way."""
        pushed_out: list[Ticket[T]] = []
        if self._size >= self.config.max_queued:
            active = self.clients() + (0 if self.queued_by(client) else 1)
            fair = self.config.max_queued / max(1, active)
            mine = self.queued_by(client)
            if mine >= fair or mine + 1 > self.config.max_queued:
                message = (
                    f"the router's queue is full ({self.config.max_queued} requests waiting for an engine) and "
                    f"this client already has {mine} of them, its fair share"
                )
                return Pushed(None, refused=self._shed_answer(429, "queue_full", message, pool, now))
            victim = self._newest_of_largest(exclude=client)
            if victim is None:  # cannot happen while the arithmetic above holds; refuse rather than overfill
                message = f"the router's queue is full ({self.config.max_queued} requests waiting for an engine)"
                return Pushed(None, refused=self._shed_answer(503, "queue_full", message, pool, now))
            held = self.queued_by(victim.client)
            self._leave(victim, "shed")
            victim.shed = self._shed_answer(
                429,
                "client_share",
                f"this request was removed from the router's full queue for another client's: this client had "
                f"{held} requests waiting, more than its fair share ({fair:.0f})",
                victim.pool,
                now,
            )
            pushed_out.append(victim)
        ticket = self._enqueue(item, client, pool, tokens, now)
        return Pushed(ticket, pushed_out=tuple(pushed_out))

    def admitted(self, client: str, tokens: int) -> None:
        """A request went to an engine without waiting (nothing waited, and an engine had room): it is charged to
        its client as if it had waited and been taken, so a client that filled the engines before others came does
        not also go first once a queue forms."""
        state = self._clients.get(client)
        if state is None:
            state = self._clients[client] = _Client()
        start = max(self._virtual, state.finish)
        state.finish = start + max(1, tokens)
        self._max_finish = max(self._max_finish, state.finish)
        self._virtual = start
        self._maybe_sweep()

    def _enqueue(self, item: T, client: str, pool: Pool, tokens: int, now: float) -> Ticket[T]:
        config = self.config
        self._seq += 1
        cost = max(1, tokens)
        deadline = now + config.ttft_target_s if config.ttft_target_s is not None else None
        ticket = Ticket(item, client, pool, tokens, cost, now, deadline, now + config.max_wait_s, self._seq)
        state = self._clients.get(client)
        if state is None:
            state = self._clients[client] = _Client()
        ticket.start = max(self._virtual, state.finish)
        state.finish = ticket.start + cost
        self._max_finish = max(self._max_finish, state.finish)
        state.tickets.append(ticket)
        state.queued += 1
        queue = self._pools[pool]
        heapq.heappush(queue.fresh, (ticket.start, ticket.seq, ticket))
        queue.requests += 1
        queue.tokens += tokens
        self._arrivals.append(ticket)
        self._size += 1
        return ticket

    # -- leaving ----------------------------------------------------------------------------------------------

    def candidates(self, now: float) -> list[Ticket[T]]:
        """The head of each pool's queue, in the order to try them: fresh before late, then by start tag."""
        heads = [head for pool in POOLS if (head := self._head(pool, now)) is not None]
        heads.sort(key=lambda ticket: (ticket.late, ticket.start, ticket.seq))
        return heads

    def take(self, ticket: Ticket[T], now: float) -> None:
        """The request got an engine: it leaves the queue and the virtual time moves to its start tag."""
        queue = self._pools[ticket.pool]
        self._virtual = max(self._virtual, ticket.start)
        self._leave(ticket, "taken")
        if queue.rate:
            queue.rate *= math.exp(-(now - queue.rate_at) / RATE_WINDOW_S)
        queue.rate += 1.0 / RATE_WINDOW_S
        queue.rate_at = now

    def remove(self, ticket: Ticket[T]) -> None:
        """The request ended while waiting (its client left, its deadline passed elsewhere): forget it."""
        if ticket.state == "queued":
            self._leave(ticket, "removed")

    def expire(self, now: float) -> list[Ticket[T]]:
        """Shed (`deadline`) and return every request that has waited `max_wait_s`; each carries its `Shed`."""
        out: list[Ticket[T]] = []
        while True:
            self._drop_dead_arrivals()
            if not self._arrivals or self._arrivals[0].expires > now:
                return out
            ticket = self._arrivals[0]
            self._leave(ticket, "shed")
            waited = now - ticket.arrival
            ticket.shed = self._shed_answer(
                503,
                "deadline",
                f"no {ticket.pool} engine had room for this request within {waited:.1f} s (the router's longest "
                f"useful wait is {self.config.max_wait_s:g} s; {self._pools[ticket.pool].requests + 1} requests "
                f"were waiting for one): it could no longer meet a useful deadline",
                ticket.pool,
                now,
            )
            out.append(ticket)

    def drain(self, now: float) -> list[Ticket[T]]:
        """Shed every waiting request (`shutdown`) and return them."""
        out: list[Ticket[T]] = []
        for ticket in list(self._arrivals):
            if ticket.state != "queued":
                continue
            self._leave(ticket, "shed")
            ticket.shed = Shed(
                503,
                "shutdown",
                "the router is shutting down before an engine had room for this request; retry (another router "
                "replica serves it)",
                self.config.retry_after_s,
            )
            out.append(ticket)
        self._arrivals.clear()
        return out

    def __iter__(self) -> Iterator[Ticket[T]]:
        """Every waiting request, oldest first."""
        return (ticket for ticket in self._arrivals if ticket.state == "queued")

    # -- inside -----------------------------------------------------------------------------------------------

    def _head(self, pool: Pool, now: float) -> Ticket[T] | None:
        """The pool's next request: the fresh head, moved to the late heap while it can no longer make its
        deadline; else the late head."""
        queue = self._pools[pool]
        while queue.fresh:
            ticket = queue.fresh[0][2]
            if ticket.state != "queued":
                heapq.heappop(queue.fresh)
                continue
            if ticket.deadline is not None and now + self._service_s(ticket) > ticket.deadline:
                heapq.heappop(queue.fresh)
                ticket.late = True
                heapq.heappush(queue.late, (ticket.start, ticket.seq, ticket))
                continue
            return ticket
        while queue.late:
            late = queue.late[0][2]
            if late.state != "queued":
                heapq.heappop(queue.late)
                continue
            return late
        return None

    def _leave(self, ticket: Ticket[T], state: Literal["taken", "shed", "removed"]) -> None:
        """Take a queued ticket out of the counts (its heap entries are dropped lazily)."""
        assert ticket.state == "queued", ticket.state
        ticket.state = state
        queue = self._pools[ticket.pool]
        queue.requests -= 1
        queue.tokens -= ticket.tokens
        self._size -= 1
        if not self._size:
            # The end of a busy period: SFQ's virtual time (the start tag in service) jumps past every tag given,
            # so a client's history does not outlive the backlog it made.
            self._virtual = max(self._virtual, self._max_finish)
        client = self._clients[ticket.client]
        client.queued -= 1
        if state != "taken" and client.finish == ticket.start + ticket.cost:
            client.finish = ticket.start  # its newest request never ran: the client is not charged for it
        while client.tickets and client.tickets[0].state != "queued":
            client.tickets.popleft()
        self._maybe_sweep()

    def _maybe_sweep(self) -> None:
        self._until_sweep -= 1
        if self._until_sweep <= 0 and len(self._clients) > 2 * self._size + 64:
            self._forget_idle_clients()

    def _forget_idle_clients(self) -> None:
        """Forget clients with nothing queued and no tag ahead of the virtual time: max(virtual, finish) would
        give their next request the virtual time anyway. Run when the clients known outnumber twice the waiting
        requests, at most once per as many requests leaving as clients were kept (amortised O(1) per request)."""
        virtual = self._virtual
        idle = [name for name, client in self._clients.items() if not client.queued and client.finish <= virtual]
        for name in idle:
            del self._clients[name]
        self._until_sweep = len(self._clients)

    def _newest_of_largest(self, exclude: str) -> Ticket[T] | None:
        """The newest waiting request of the client with the most waiting (other than `exclude`)."""
        candidates = [(state.queued, name) for name, state in self._clients.items() if name != exclude and state.queued]
        if not candidates:
            return None
        _, name = max(candidates)
        tickets = self._clients[name].tickets
        while tickets and tickets[-1].state != "queued":
            tickets.pop()
        return tickets[-1] if tickets else None

    def _drop_dead_arrivals(self) -> None:
        arrivals = self._arrivals
        while arrivals and arrivals[0].state != "queued":
            arrivals.popleft()

    def _shed_answer(self, status: int, reason: ShedReason, message: str, pool: Pool, now: float) -> Shed:
        after = self.retry_after(pool, now)
        return Shed(status, reason, f"{message}; retry after {after} s", after)
