"""One prefill engine and one decode engine in virtual time, with the simulator's cost model and scheduling rules.

Both follow `pdserve_sim.engine` (see its docstring) step for step, and charge every step exactly
`TimingParams.step_seconds(prefill_tokens, decode_batch, decode_context)` of the preset:

- Prefill (PD prefill role): running (partly prefilled) requests first, then waiting ones first come first
  served, while the step has token budget (`max_num_batched_tokens`) and a sequence slot; a prompt longer than
  the budget is chunked over steps. A request ends with its prefill (one token, as PD prefill does); its KV is
  then pulled by a decode engine.
- Decode: requests that finished pulling their KV rejoin first, each with a one-token prefill step (the last
  prompt token is recomputed to sample the first token); then waiting requests in order, while there is a slot
  and KV room for the prompt (head-of-line blocking, as vLLM's scheduler): a PD request reserves its blocks and
  starts its pull outside the batch; a short prompt routed straight to decode prefills inside the step, which
  slows that step for every sequence in it. Every decoding sequence gets one token per step and its context
  grows by one. `tests/dev/test_replay_engines.py` checks these times against the real `Engine` driven on a
  virtual clock.

Granularity: the state of the decode batch is (batch size, summed context, a heap of finish steps), so a step
costs O(requests that join or finish), not O(batch). Simplifications, none of which matter at the replayed
loads: KV is counted in tokens, not blocks; preemption is not modelled (admission reserves the prompt and
growth is checked against the cache, `kv_overflows` counts steps that would have preempted); a prefill
engine's held KV is not charged against its cache (H200-sized caches hold many times the in-flight prompts).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable

from pdserve.api.latency_buckets import ROUTER_ITL_BUCKETS, ROUTER_TTFT_BUCKETS
from pdserve_dev.replay.histogram import Histogram
from pdserve_dev.replay.trace import Request
from pdserve_sim.metrics import (
    ITL_BUCKETS,
    NIXL_XFER_TIME_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    build_1_2_5_buckets,
)
from pdserve_sim.presets import TimingParams

__all__ = ["ROUTER_ITL_BUCKETS", "ROUTER_TTFT_BUCKETS", "DecodeEngine", "EngineCounters", "Job", "PrefillEngine"]

Schedule = Callable[[float, Callable[[float], None]], None]


class Job:
    """One request on its way through the service, with the times the outcome is computed from."""

    __slots__ = (
        "admitted",
        "arrival",
        "client_s",
        "decode_arrival",
        "dispatched",
        "finished",
        "first_token",
        "output",
        "prefill_arrival",
        "prefill_done",
        "prompt",
        "pull_done",
        "remaining",
        "route",
    )

    def __init__(self, request: Request, route: str) -> None:
        self.arrival = request.arrival
        self.prompt = request.prompt
        self.output = request.output
        self.route = route
        self.remaining = request.prompt
        #: When the router sent it to its first engine (its queue wait ends; on arrival without late binding).
        self.dispatched = request.arrival
        self.prefill_arrival = 0.0
        self.prefill_done = 0.0
        self.decode_arrival = 0.0
        self.admitted = 0.0
        self.pull_done = 0.0
        #: The router's first byte (`first_token`) to the client's (`path.PathCosts.client`).
        self.client_s = 0.0
        #: The router's first byte of the answer (its TTFT counts from `arrival` to here).
        self.first_token: float | None = None
        self.finished: float | None = None

    @property
    def ttft(self) -> float | None:
        """The client's time to first token: from its arrival at the router to the first token reaching it."""
        return None if self.first_token is None else self.first_token + self.client_s - self.arrival

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first (0 for one-token outputs)."""
        if self.output <= 1 or self.first_token is None or self.finished is None:
            return 0.0
        return (self.finished - self.first_token) / (self.output - 1)


class EngineCounters:
    """An engine's cumulative metrics, the ones its /metrics would export (names in comments)."""

    __slots__ = (
        "busy_s",
        "engine_itl",
        "engine_ttft",
        "generated_tokens",
        "kv_transfer",
        "local_tokens",
        "prompt_tokens",
        "prompt_tokens_hist",
        "queue_time",
        "requests",
    )

    def __init__(self, max_model_len: int) -> None:
        self.requests = 0  # vllm:request_success_total
        self.prompt_tokens = 0  # vllm:prompt_tokens_total
        self.local_tokens = 0  # vllm:prompt_tokens_by_source_total{source="local_compute"}
        self.generated_tokens = 0  # vllm:generation_tokens_total
        self.busy_s = 0.0  # what DCGM's GPU utilisation would integrate
        self.engine_ttft = Histogram(TTFT_BUCKETS)  # vllm:time_to_first_token_seconds
        self.engine_itl = Histogram(ITL_BUCKETS)  # vllm:inter_token_latency_seconds
        self.queue_time = Histogram(REQUEST_LATENCY_BUCKETS)  # vllm:request_queue_time_seconds
        self.kv_transfer = Histogram(NIXL_XFER_TIME_BUCKETS)  # vllm:nixl_xfer_time_seconds
        self.prompt_tokens_hist = Histogram(build_1_2_5_buckets(max_model_len))  # vllm:request_prompt_tokens


class InOrderArrivals:
    """Requests the router sends one engine arrive in the order they were sent: a real engine reads, parses and
    tokenizes them one at a time on its event loop, so a shorter prompt sent a moment after a longer one does not
    overtake it, although its own hops (`path`) cost less (the closed loop shows the longer one first every time)."""

    _last_arrival: float

    def _arrival(self, at: float) -> float:
        """When a request due at `at` arrives: not before the one sent before it."""
        self._last_arrival = max(at, self._last_arrival)
        return self._last_arrival


class PrefillEngine(InOrderArrivals):
    """A PD prefill engine."""

    def __init__(self, timing: TimingParams, schedule: Schedule, done: Callable[[Job, float], None]) -> None:
        self.timing = timing
        self._schedule = schedule
        self._done = done
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self.busy = False
        self.outstanding_tokens = 0
        #: Requests the router has sent that have not arrived yet (`send`).
        self.in_transit = 0
        self._last_arrival = 0.0
        self.counters = EngineCounters(timing.max_model_len)
        self._step: list[tuple[Job, int]] = []
        #: Called when the engine runs out of work (the cluster sets it on a draining replica).
        self.on_idle: Callable[[float], None] | None = None

    @property
    def idle(self) -> bool:
        return not self.busy and not self.waiting and not self.running and not self.in_transit

    def gauges(self) -> tuple[int, int]:
        """(running, waiting) as vllm:num_requests_running / _waiting would read now."""
        return len(self.running), len(self.waiting)

    def add(self, job: Job, now: float) -> None:
        self.outstanding_tokens += job.prompt
        self._arrive(job, now)

    def send(self, job: Job, now: float, delay: float) -> None:
        """The router sends `job`, which arrives `delay` later (`path.PathCosts.dispatch_s`); its tokens count
        as outstanding from now on, as the router's in-flight count has them from the moment it sends."""
        if delay <= 0:
            self.add(job, now)
            return
        self.outstanding_tokens += job.prompt
        self.in_transit += 1

        def arrive(at: float) -> None:
            self.in_transit -= 1
            self._arrive(job, at)

        self._schedule(self._arrival(now + delay), arrive)

    def _arrive(self, job: Job, now: float) -> None:
        job.prefill_arrival = now
        self.waiting.append(job)
        if not self.busy:
            self._plan(now)

    def _plan(self, now: float) -> None:
        timing = self.timing
        budget = timing.max_num_batched_tokens
        items: list[tuple[Job, int]] = []
        for job in self.running:
            if budget <= 0:
                break
            n = min(job.remaining, budget)
            items.append((job, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < timing.max_num_seqs:
            job = self.waiting.popleft()
            job.admitted = now
            self.counters.queue_time.observe(now - job.prefill_arrival)
            self.running.append(job)
            n = min(job.remaining, budget)
            items.append((job, n))
            budget -= n
        if not items:
            self.busy = False
            if self.on_idle is not None and not self.in_transit:
                self.on_idle(now)
            return
        tokens = timing.max_num_batched_tokens - budget
        pairs = sum(timing.prefill_pairs(job.prompt - job.remaining, n) for job, n in items)
        seconds = timing.step_seconds(tokens, 0, 0, pairs)
        self.counters.busy_s += seconds
        self.busy = True
        self._step = items
        self._schedule(now + seconds, self._on_step)

    def _on_step(self, now: float) -> None:
        counters = self.counters
        finished = False
        for job, n in self._step:
            job.remaining -= n
            counters.local_tokens += n
            if job.remaining <= 0:
                finished = True
        if finished:
            still: list[Job] = []
            for job in self.running:
                if job.remaining > 0:
                    still.append(job)
                    continue
                job.prefill_done = now
                counters.requests += 1
                counters.prompt_tokens += job.prompt
                counters.generated_tokens += 1
                counters.engine_ttft.observe(now - job.prefill_arrival)
                counters.prompt_tokens_hist.observe(job.prompt)
                self.outstanding_tokens -= job.prompt
                self._done(job, now)
            self.running = still
        self._plan(now)


class DecodeEngine(InOrderArrivals):
    """A PD decode engine (also serves short prompts routed straight to it)."""

    def __init__(
        self,
        timing: TimingParams,
        schedule: Schedule,
        finished: Callable[[Job, float], None],
        first_token: Callable[[Job, float], None],
        itl: Callable[[float, int], None],
        *,
        kv_transfer: Callable[[int], float] | None = None,
    ) -> None:
        self.timing = timing
        #: Seconds a PD pull takes beyond the modelled link time, per prompt (`path.PathCosts.kv_transfer`).
        self._kv_extra = kv_transfer
        self._schedule = schedule
        self._finished = finished
        self._first_token = first_token
        self._itl = itl
        self.waiting: deque[Job] = deque()
        self.joinable: deque[Job] = deque()
        self.pulling = 0
        #: Requests the router has sent that have not arrived yet (`send`).
        self.in_transit = 0
        self._last_arrival = 0.0
        self.batch = 0
        self.context = 0
        #: KV tokens held by requests outside the batch (pulling, pulled, joining this step).
        self.kv_other = 0
        self.kv_capacity = timing.num_kv_blocks * timing.block_size
        self.kv_overflows = 0
        self.steps = 0
        self._finish_heap: list[tuple[int, int, Job]] = []
        self._seq = 0
        self.busy = False
        self.counters = EngineCounters(timing.max_model_len)
        self._joining: list[tuple[Job, int]] = []
        self._step_batch = 0
        self._step_started = 0.0
        #: Called when the engine runs out of work (the cluster sets it on a draining replica).
        self.on_idle: Callable[[float], None] | None = None
        #: The latest step: (decoding sequences, their summed context, seconds), as a forward-pass metric reports it.
        self.last_pass: tuple[int, int, float] | None = None

    @property
    def idle(self) -> bool:
        return (
            not self.busy
            and self.batch == 0
            and not self.waiting
            and not self.joinable
            and self.pulling == 0
            and self.in_transit == 0
        )

    @property
    def load(self) -> int:
        """Requests on this engine or on their way to it (the router's in-flight count)."""
        return self.batch + len(self._joining) + len(self.waiting) + len(self.joinable) + self.pulling + self.in_transit

    def gauges(self) -> tuple[int, int, int, float]:
        """(running, waiting for capacity, waiting on KV, KV usage) as the engine's gauges read now."""
        waiting = len(self.waiting) + len(self.joinable)
        usage = (self.context + self.kv_other) / self.kv_capacity
        return self.batch + len(self._joining), waiting, self.pulling, min(usage, 1.0)

    def add(self, job: Job, now: float) -> None:
        job.decode_arrival = now
        self.waiting.append(job)
        if not self.busy:
            self._plan(now)

    def send(self, job: Job, now: float, delay: float) -> None:
        """The router sends `job`, which arrives `delay` later; it counts in `load` from now on."""
        if delay <= 0:
            self.add(job, now)
            return
        self.in_transit += 1

        def arrive(at: float) -> None:
            self.in_transit -= 1
            self.add(job, at)

        self._schedule(self._arrival(now + delay), arrive)

    def _kv_seconds(self, job: Job) -> float:
        timing = self.timing
        extra = self._kv_extra(job.prompt) if self._kv_extra is not None else 0.0
        if timing.kv_link_bytes_per_second <= 0:
            return extra
        return job.prompt * timing.kv_model_bytes_per_token / timing.kv_link_bytes_per_second + extra

    def _pulled(self, job: Job) -> Callable[[float], None]:
        def done(now: float) -> None:
            self.pulling -= 1
            job.pull_done = now
            self.counters.kv_transfer.observe(now - job.admitted)
            self.joinable.append(job)
            if not self.busy:
                self._plan(now)

        return done

    def _plan(self, now: float) -> None:
        timing = self.timing
        budget = timing.max_num_batched_tokens - self.batch
        joining: list[tuple[Job, int]] = []
        while self.joinable and budget > 0 and self.batch + len(joining) < timing.max_num_seqs:
            joining.append((self.joinable.popleft(), 1))
            budget -= 1
        while self.waiting and budget > 0 and self.batch + len(joining) < timing.max_num_seqs:
            job = self.waiting[0]
            if self.context + self.kv_other + job.prompt > self.kv_capacity:
                break
            if job.route != "pd" and job.prompt > budget:
                break
            self.waiting.popleft()
            job.admitted = now
            self.counters.queue_time.observe(now - job.decode_arrival)
            self.kv_other += job.prompt
            if job.route == "pd":
                self.pulling += 1
                self._schedule(now + self._kv_seconds(job), self._pulled(job))
                continue
            joining.append((job, job.prompt))
            budget -= job.prompt
        if self.batch == 0 and not joining:
            self.busy = False
            if self.on_idle is not None and self.idle:
                self.on_idle(now)
            return
        prefill_tokens = sum(n for _, n in joining)
        pairs = sum(timing.prefill_pairs(0, n) for _, n in joining)
        seconds = timing.step_seconds(prefill_tokens, self.batch, self.context, pairs)
        self.counters.busy_s += seconds
        self.busy = True
        self._joining = joining
        self._step_batch = self.batch
        self._step_started = now
        self.last_pass = (self.batch, self.context, seconds)
        self._schedule(now + seconds, self._on_step)

    def _on_step(self, now: float) -> None:
        self.steps += 1
        step = self.steps
        counters = self.counters
        batch = self._step_batch
        if batch:
            gap = now - self._step_started
            counters.engine_itl.observe(gap, batch)
            self._itl(gap, batch)
            counters.generated_tokens += batch
            self.context += batch
            if self.context + self.kv_other > self.kv_capacity:
                self.kv_overflows += 1
        heap = self._finish_heap
        while heap and heap[0][0] <= step:
            _, _, job = heapq.heappop(heap)
            self.context -= job.prompt + job.output - 1
            self.batch -= 1
            self._finish(job, now)
        for job, n in self._joining:
            job.first_token = now
            counters.generated_tokens += 1
            counters.engine_ttft.observe(now - job.decode_arrival)
            if job.route != "pd":
                counters.local_tokens += n
            self.kv_other -= job.prompt
            self._first_token(job, now)
            if job.output <= 1:
                self._finish(job, now)
                continue
            self.batch += 1
            self.context += job.prompt
            self._seq += 1
            heapq.heappush(heap, (step + job.output - 1, self._seq, job))
        self._joining = []
        self._plan(now)

    def _finish(self, job: Job, now: float) -> None:
        job.finished = now
        counters = self.counters
        counters.requests += 1
        counters.prompt_tokens += job.prompt
        counters.prompt_tokens_hist.observe(job.prompt)
        self._finished(job, now)
