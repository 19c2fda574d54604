"""The simulated engine core: a continuous-batching scheduler loop over a modelled clock.

Algorithm (one iteration of ``Engine._run``, the shape of vLLM v1's scheduler):
1. Plan a step with a token budget (``max_num_batched_tokens``):
   - running requests first, in arrival order: a decoding request takes 1 token, a request still in (chunked)
     prefill takes ``min(remaining prompt, budget)``. Each needs KV blocks for its tokens; if the pool is
     empty the most recently admitted running request is preempted (its blocks freed, it returns to the
     head of the waiting queue and later recomputes prompt + generated tokens), as vLLM's recompute
     preemption does;
   - then waiting requests, first come first served, while there is budget, a free sequence slot
     (``max_num_seqs``) and blocks. On admission a request reuses the longest cached prefix of its prompt
     blocks (prefix cache hits skip compute). The head of the queue blocks the rest when blocks run out
     (``num_requests_waiting_by_reason{reason="capacity"}``).
   - a request whose prefill was done remotely (PD decode, ``do_remote_prefill``) is admitted by allocating
     blocks for its whole prompt and starting a KV pull over the side channel; it waits outside the batch
     until the pull finishes, then needs one step to produce its first token.
2. Sleep the step's modelled duration (``TimingParams.step_seconds`` divided by ``speed``); in fast mode
   just yield to the event loop. Sleeps chain on deadlines, so event-loop jitter does not accumulate.
3. Apply the step: advance computed tokens, register newly full prompt blocks in the prefix cache, emit one
   token to every request that finished its prefill or decoded, and finish requests at their limit.

A prefill-only request (PD prefill, ``do_remote_decode``) keeps its KV blocks after it finishes, for a lease
of ``kv_lease_seconds``, until a decode engine has read them and notified (then they are freed) or the lease
expires. A pull that fails midway frees nothing, as in vLLM's NixlConnector.

With a KV store (``kvstore``): a writer engine puts a finished request's full prompt blocks into the store
behind the answer (``EngineRequest.store_put``, as vLLM's connector queues the save), and every engine loads the
blocks of a new prompt the store holds beyond its own cache before the request is queued (``preload``), placing
them in its cache as computed.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pdserve.api.kvevents import Event
from pdserve_sim.config import SimConfig
from pdserve_sim.kvcache import BlockPool, block_hashes
from pdserve_sim.kvevents import KvEventRecorder
from pdserve_sim.kvstore import KVStore, StoreError
from pdserve_sim.metrics import SimMetrics
from pdserve_sim.presets import TimingParams
from pdserve_sim.tokenizer import generation_seed

log = logging.getLogger(__name__)


class State(enum.Enum):
    """Lifecycle of a request inside the engine."""

    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """Where a decode request finds its prompt's KV (from the prefill engine's kv_transfer_params)."""

    engine_id: str
    request_id: str
    host: str
    port: int
    block_ids: tuple[int, ...]
    num_tokens: int | None


class KVLoadError(Exception):
    """A KV pull that failed for good (after retries, or with a definitive refusal from the peer)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(slots=True)
class HeldKV:
    """KV blocks a prefill engine keeps for a decode engine to pull."""

    request_id: str
    blocks: list[int]
    num_tokens: int
    expires_at: float
    timer: asyncio.TimerHandle | None = None


PullFunc = Callable[["EngineRequest"], "asyncio.Future[int] | Any"]


class EngineRequest:
    """One request's state in the engine, and the channel its tokens reach the HTTP handler through."""

    __slots__ = (
        "_waiter",
        "arrival",
        "blocks",
        "error",
        "error_status",
        "external_tokens",
        "finish_reason",
        "finished_at",
        "first_scheduled",
        "first_token_at",
        "hashes",
        "kv_loaded",
        "kv_transfer_params_out",
        "last_token_at",
        "max_tokens",
        "min_tokens",
        "num_cached_tokens",
        "num_computed",
        "outputs",
        "prefill_target",
        "prompt_ids",
        "pull_task",
        "registered_blocks",
        "remote_decode",
        "remote_prefill",
        "request_id",
        "seed",
        "state",
        "stop_after",
        "store_put",
        "store_tokens",
        "wants_tokens",
    )

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        max_tokens: int,
        *,
        min_tokens: int = 0,
        stop_after: int | None = None,
        remote_decode: bool = False,
        remote_prefill: RemotePrefill | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        #: Generate an end-of-sequence after this many tokens (finish_reason "stop"); None = never.
        self.stop_after = stop_after
        self.remote_decode = remote_decode
        self.remote_prefill = remote_prefill
        self.seed = generation_seed(prompt_ids)
        self.state = State.WAITING
        self.arrival = time.monotonic()
        self.first_scheduled: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.finished_at: float | None = None
        self.num_computed = 0
        self.prefill_target = len(prompt_ids)
        self.outputs = 0
        self.blocks: list[int] = []
        self.hashes: list[int] | None = None
        self.registered_blocks = 0
        self.num_cached_tokens = 0
        self.external_tokens = 0
        self.kv_loaded = False
        self.pull_task: asyncio.Task[None] | None = None
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.error_status = 500
        self.kv_transfer_params_out: dict[str, Any] | None = None
        #: The put of this request's prompt blocks into the KV store, when the engine writes to one.
        self.store_put: asyncio.Future[None] | None = None
        #: Prompt tokens loaded from the KV store into this engine's cache for this request (``Engine.preload``).
        self.store_tokens = 0
        self._waiter: asyncio.Future[None] | None = None
        #: False for non-streaming requests: their handler is only woken when the request finishes.
        self.wants_tokens = True

    @property
    def finished(self) -> bool:
        """True once the engine will produce nothing more for this request."""
        return self.state is State.FINISHED

    async def wait_beyond(self, sent: int) -> None:
        """Return once more than ``sent`` tokens exist or the request finished."""
        if self.outputs > sent or self.state is State.FINISHED:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiter = waiter
        await waiter

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)


class Engine:
    """Continuous-batching scheduler, KV pool, PD state and metrics of one simulated engine."""

    def __init__(self, config: SimConfig, metrics: SimMetrics) -> None:
        self.config = config
        self.timing = config.timing
        self.metrics = metrics
        self.pool = BlockPool(self.timing.num_kv_blocks, self.timing.block_size)
        #: The pool's changes since the last step, when KV events are on (`kvevents`); the server sets `publish`.
        self.kv_events = KvEventRecorder(self.timing.block_size) if config.kv_events is not None else None
        if self.kv_events is not None:
            self.pool.on_evict = self.kv_events.removed
        self.publish_events: Callable[[list[Event]], None] | None = None
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.remote_waiting: dict[str, EngineRequest] = {}
        self.held: dict[str, HeldKV] = {}
        #: Held KV not released yet (in `held` until a reader's notification or the lease frees it).
        self.kv_outstanding = 0
        self._kv_settled = asyncio.Event()
        self._kv_settled.set()
        #: Recently expired or pulled request ids, so a late pull gets a precise error (bounded).
        self.gone: OrderedDict[str, str] = OrderedDict()
        #: Handshakes with prefill peers (host, port, engine id), done or in progress.
        self.peers: dict[tuple[str, int, str], asyncio.Future[None]] = {}
        #: Set by the server: pulls a decode request's KV from its prefill engine (the side channel client).
        self.pull: Callable[[EngineRequest], Any] | None = None
        #: Set by the server when the engine has a KV store (vLLM's MooncakeStoreConnector).
        self.store: KVStore | None = None
        self._work = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    # ----------------------------------------------------------------------------------------------------
    # Lifecycle

    def start(self) -> None:
        """Start the scheduler loop on the running event loop."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        """Stop the loop, finish every request as aborted and drop held KV."""
        self._stopping = True
        self._work.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for req in [*self.running, *self.waiting, *self.remote_waiting.values()]:
            self._finish(req, "abort")
        for held in self.held.values():
            if held.timer is not None:
                held.timer.cancel()
        self.held.clear()
        self.kv_outstanding = 0
        self._kv_settled.set()

    async def kv_settled(self) -> None:
        """Wait until no KV this engine handed out is left: every block was pulled or its lease expired.

        A draining prefill engine waits for this before it stops, as vLLM's engine core keeps stepping under a
        shutdown timeout while finished requests still wait for their KV to be read (vLLM PR #43433).
        """
        await self._kv_settled.wait()

    # ----------------------------------------------------------------------------------------------------
    # Requests

    def add(self, req: EngineRequest) -> None:
        """Queue a request."""
        req.arrival = time.monotonic()
        self.waiting.append(req)
        self._work.set()

    def abort(self, req: EngineRequest) -> None:
        """Cancel a request (client disconnect or /abort); frees its blocks."""
        if req.state is State.FINISHED:
            return
        if req.state is State.WAITING:
            with contextlib.suppress(ValueError):
                self.waiting.remove(req)
        elif req.state is State.RUNNING:
            self.running.remove(req)
        elif req.state is State.WAITING_FOR_REMOTE_KV:
            self.remote_waiting.pop(req.request_id, None)
            if req.pull_task is not None:
                req.pull_task.cancel()
        self._finish(req, "abort")
        self._update_gauges()

    def find(self, request_id: str) -> EngineRequest | None:
        """A live request by id (for /abort)."""
        for req in (*self.running, *self.waiting, *self.remote_waiting.values()):
            if req.request_id == request_id:
                return req
        return None

    # ----------------------------------------------------------------------------------------------------
    # Held KV (prefill side of PD)

    def lend_held(self, request_id: str) -> HeldKV | str:
        """Held KV for a puller to read, or why there is none ("unknown_request", "expired", "already_pulled").

        Reading does not free the KV: like NIXL's one-sided READ, a pull leaves the blocks where they are until the
        reader's completion notification (`sent`) or the lease's end. A pull that fails or times out midway therefore
        leaves the KV pullable, by a retry of the same decode engine or by another one, as vLLM's prefill keeps
        blocks it got no notification for until `kv_lease_duration` runs out.
        """
        held = self.held.get(request_id)
        if held is None:
            return self.gone.get(request_id, "unknown_request")
        return held

    def sent(self, held: HeldKV) -> bool:
        """A reader notified that it has `held`'s KV: free the blocks. False when they were freed before (the
        lease ran out during the read, or a duplicate request id replaced them): vLLM then logs that potentially
        invalid blocks were read, and so does the simulator."""
        if self.held.get(held.request_id) is not held:
            log.warning("Got a transfer notification for KV no longer held request_id=%s", held.request_id)
            return False
        del self.held[held.request_id]
        if held.timer is not None:
            held.timer.cancel()
        self._remember_gone(held.request_id, "already_pulled")
        self.release_held(held)
        return True

    def awaiting_pull(self) -> dict[tuple[str, int], list[str]]:
        """The prefill-side request ids of PD requests still queued here for their pull, by the prefill engine's side
        channel: what vLLM's NixlConnector heartbeats while they wait, so a deep decode queue does not outlast the
        prefill engine's lease (`base_scheduler`: every `kv_lease_duration // 6` s)."""
        peers: dict[tuple[str, int], list[str]] = {}
        for req in self.waiting:
            remote = req.remote_prefill
            if remote is not None and not req.kv_loaded:
                peers.setdefault((remote.host, remote.port), []).append(remote.request_id)
        return peers

    def extend_leases(self, request_ids: Iterable[str]) -> None:
        """A decode engine's heartbeat: the KV of these requests stays held until 2/3 of this engine's lease from
        now, never less than it already had (vLLM's `_handle_heartbeat` on the prefill side)."""
        extension = self.config.kv_lease_seconds * 2 / 3
        now = time.monotonic()
        loop = asyncio.get_running_loop()
        for request_id in request_ids:
            held = self.held.get(request_id)
            if held is None or now + extension <= held.expires_at:
                continue
            held.expires_at = now + extension
            if held.timer is not None:
                held.timer.cancel()
            held.timer = loop.call_later(extension, self._expire, request_id)
            self.metrics.lease_extensions.inc()

    def release_held(self, held: HeldKV) -> None:
        """Free the blocks of held KV once it was sent (or expired, or replaced)."""
        self.pool.release(held.blocks)
        self.kv_outstanding -= 1
        if self.kv_outstanding <= 0:
            self.kv_outstanding = 0
            self._kv_settled.set()
        self._update_gauges()
        self._work.set()

    def _expire(self, request_id: str) -> None:
        held = self.held.pop(request_id, None)
        if held is None:
            return
        log.info("Expired held KV request_id=%s blocks=%d", request_id, len(held.blocks))
        self.metrics.nixl_expired.inc()
        self._remember_gone(request_id, "expired")
        self.release_held(held)

    def _remember_gone(self, request_id: str, why: str) -> None:
        self.gone[request_id] = why
        while len(self.gone) > 10000:
            self.gone.popitem(last=False)

    # ----------------------------------------------------------------------------------------------------
    # The scheduler loop

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        fast = self.config.fast
        speed = self.config.speed
        deadline = loop.time()
        while not self._stopping:
            if not self.running and not self.waiting:
                self._work.clear()
                await self._work.wait()
                deadline = loop.time()
                continue
            try:
                plan = self._schedule()
            except Exception:  # pragma: no cover - a bug; keep serving and make it loud
                log.exception("Scheduler step failed")
                await asyncio.sleep(0.01)
                continue
            if not plan.items:
                # Nothing schedulable (e.g. the queue head waits for blocks held by leases): wait for a change.
                self._work.clear()
                self._update_gauges()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._work.wait(), timeout=0.05)
                deadline = loop.time()
                continue
            self._update_gauges()
            if fast:
                await asyncio.sleep(0)
            else:
                seconds = self.timing.step_seconds(
                    plan.prefill_tokens, plan.decode_batch, plan.decode_context, plan.prefill_pairs
                )
                # Chain steps on deadlines: a step that starts late (event-loop busy) is shortened so the
                # modelled rate holds, but never by more than 50 ms of accumulated lag.
                deadline = max(deadline, loop.time() - 0.05) + seconds / speed
                delay = deadline - loop.time()
                await asyncio.sleep(delay if delay > 0 else 0)
                lag = loop.time() - deadline
                self.metrics.step_lag.set(lag)
                if lag > 0.005:
                    self.metrics.late_steps.inc()
            self._apply(plan)
            self._flush_events()

    def _register_blocks(self, req: EngineRequest, full: int) -> None:
        """Enter the request's full prompt blocks up to `full` into the prefix cache (and the KV events)."""
        hashes = req.hashes
        assert hashes is not None
        recorder = self.kv_events
        bs = self.timing.block_size
        for j in range(req.registered_blocks, full):
            if self.pool.register(req.blocks[j], hashes[j]) and recorder is not None:
                recorder.stored(hashes[j], hashes[j - 1] if j else None, req.prompt_ids[j * bs : (j + 1) * bs])
        req.registered_blocks = max(req.registered_blocks, full)

    def _flush_events(self) -> None:
        """Hand this step's KV events to the publisher (one batch per step that changed the cache, as vLLM)."""
        if self.kv_events is not None and self.publish_events is not None:
            events = self.kv_events.take()
            if events:
                self.publish_events(events)

    def _schedule(self) -> _Plan:
        t = self.timing
        pool = self.pool
        budget = t.max_num_batched_tokens
        plan = _Plan()
        i = 0
        running = self.running
        bs = t.block_size
        items = plan.items
        decode_batch = decode_context = 0
        while i < len(running) and budget > 0:
            req = running[i]
            computed = req.num_computed
            if computed >= req.prefill_target and (computed + 1 + bs - 1) // bs <= len(req.blocks):
                # Hot path: a decode step that fits in the blocks it has (inlined plan.add).
                items.append((req, 1, False))
                decode_batch += 1
                decode_context += computed
                budget -= 1
                i += 1
                continue
            prefilling = computed < req.prefill_target
            n = min(req.prefill_target - computed, budget) if prefilling else 1
            need = pool.blocks_for(computed + n) - len(req.blocks)
            if need > 0 and need > pool.num_free:
                # Out of blocks: preempt from the back (latest admitted) until this request fits.
                while need > pool.num_free and running[-1] is not req:
                    self._preempt(running.pop())
                if need > pool.num_free:
                    running.pop(i)
                    self._preempt(req)
                    continue
            if need > 0:
                req.blocks.extend(pool.allocate(need) or ())
            plan.add(req, n, prefilling)
            budget -= n
            i += 1
        plan.decode_batch += decode_batch
        plan.decode_context += decode_context

        # Admit waiting requests.
        while self.waiting and budget > 0 and len(running) < t.max_num_seqs:
            req = self.waiting[0]
            if req.state is State.FINISHED:
                self.waiting.popleft()
                continue
            hit = self._lookup_prefix(req) if not req.blocks else []
            if req.remote_prefill is not None and not req.kv_loaded:
                # PD decode: reserve blocks for the whole prompt and pull the KV; no compute this step.
                need = pool.blocks_for(len(req.prompt_ids)) - len(hit)
                if need > pool.num_free - pool.num_unreferenced(hit):
                    break
                self.waiting.popleft()
                self._take_prefix(req, hit)
                req.blocks.extend(pool.allocate(need) or ())
                self._start_pull(req)
                continue
            start = req.num_computed if req.blocks else len(hit) * t.block_size
            n = min(req.prefill_target - start, budget)
            need = pool.blocks_for(start + n) - len(req.blocks) - len(hit)
            if need > pool.num_free - pool.num_unreferenced(hit):
                break
            self.waiting.popleft()
            if hit or not req.blocks:
                self._take_prefix(req, hit)
            if need > 0:
                req.blocks.extend(pool.allocate(need) or ())
            req.state = State.RUNNING
            if req.first_scheduled is None:
                req.first_scheduled = time.monotonic()
            running.append(req)
            plan.add(req, n, True)
            budget -= n
        return plan

    def _lookup_prefix(self, req: EngineRequest) -> list[int]:
        bs = self.timing.block_size
        if req.hashes is None:
            req.hashes = block_hashes(req.prompt_ids, bs)
        # Never reuse the whole prompt: the last prompt token is always computed to produce logits.
        max_blocks = (len(req.prompt_ids) - 1) // bs
        return self.pool.lookup(req.hashes[:max_blocks])

    def _take_prefix(self, req: EngineRequest, hit: list[int]) -> None:
        """Reference the cached prefix blocks and account the prefix-cache query."""
        self.pool.acquire(hit)
        req.blocks = list(hit)
        hit_tokens = len(hit) * self.timing.block_size
        req.num_computed = hit_tokens
        req.registered_blocks = len(hit)
        if req.first_scheduled is None:
            # First admission: count the query once (a preempted request re-queries silently).
            req.num_cached_tokens = hit_tokens
            m = self.metrics
            m.prefix_queries.inc(len(req.prompt_ids))
            # Blocks the store just loaded for this request are in the cache, but came from outside.
            external = min(req.store_tokens, hit_tokens)
            local = hit_tokens - external
            req.num_cached_tokens = local
            req.external_tokens = external
            if local:
                m.prefix_hits.inc(local)
                m.tokens_by_source["local_cache_hit"].inc(local)
            if external:
                m.tokens_by_source["external_kv_transfer"].inc(external)

    def _preempt(self, req: EngineRequest) -> None:
        """Recompute preemption: drop the request's KV and requeue it at the head."""
        self.pool.release(req.blocks)
        req.blocks = []
        req.num_computed = 0
        req.registered_blocks = 0
        req.prefill_target = len(req.prompt_ids) + req.outputs
        # Pulled KV is gone too: the recompute happens locally (and counts as local compute).
        req.kv_loaded = False
        req.remote_prefill = None
        req.state = State.WAITING
        self.waiting.appendleft(req)
        self.metrics.preemptions.inc()

    def _apply(self, plan: _Plan) -> None:
        now = time.monotonic()
        m = self.metrics
        bs = self.timing.block_size
        generated = 0
        local_compute = 0
        finished_any = False
        itl = m.itl
        running_state = State.RUNNING
        for req, n, prefilling in plan.items:
            if req.state is not running_state:
                continue  # aborted while the step ran
            req.num_computed += n
            if prefilling:
                if not req.kv_loaded:
                    local_compute += n
                if req.hashes is not None:
                    full = min(req.num_computed // bs, len(req.hashes))
                    self._register_blocks(req, full)
                if req.num_computed < req.prefill_target:
                    continue
            # This request produces a token at the end of this step.
            req.outputs += 1
            generated += 1
            if req.first_token_at is None:
                req.first_token_at = now
                m.ttft.observe(now - req.arrival)
            else:
                itl.observe(now - (req.last_token_at or now))
            req.last_token_at = now
            if req.outputs >= req.max_tokens:
                self._finish(req, "length")
                finished_any = True
            elif req.stop_after is not None and req.outputs >= max(req.stop_after, req.min_tokens):
                self._finish(req, "stop")
                finished_any = True
            elif req.wants_tokens:
                req._wake()
        if finished_any:
            self.running = [r for r in self.running if r.state is running_state]
        if generated:
            m.generation_tokens.inc(generated)
        if local_compute:
            m.tokens_by_source["local_compute"].inc(local_compute)
        m.iteration_tokens.observe(plan.prefill_tokens + plan.decode_batch)
        self._update_gauges()

    def _finish(self, req: EngineRequest, reason: str, error: str | None = None) -> None:
        if req.state is State.FINISHED:
            return
        was_running = req.state is State.RUNNING
        req.state = State.FINISHED
        req.finish_reason = reason
        req.error = error
        now = time.monotonic()
        req.finished_at = now
        m = self.metrics
        store = self.store
        if store is not None and store.settings.writes and reason in ("length", "stop") and req.hashes:
            req.store_put = asyncio.ensure_future(self._store_put(req.hashes))
        if req.remote_decode and reason in ("length", "stop") and req.blocks:
            self._hold(req)
        elif req.blocks:
            self.pool.release(req.blocks)
            req.blocks = []
        if was_running or reason != "abort":
            m.success[reason if reason in m.success else "abort"].inc()
        if reason in ("length", "stop"):
            sched = req.first_scheduled or req.arrival
            first = req.first_token_at or now
            last = req.last_token_at or now
            m.e2e.observe(now - req.arrival)
            m.queue.observe(sched - req.arrival)
            m.prefill_time.observe(first - sched)
            m.decode_time.observe(last - first)
            m.inference.observe(last - sched)
            if req.outputs > 1:
                m.tpot.observe((last - first) / (req.outputs - 1))
            m.prompt_tokens.inc(len(req.prompt_ids))
            cached = req.num_cached_tokens + req.external_tokens
            if cached:
                m.prompt_tokens_cached.inc(cached)
            m.prompt_tokens_hist.observe(len(req.prompt_ids))
            m.generation_tokens_hist.observe(req.outputs)
            m.max_tokens_param.observe(req.max_tokens)
        req._wake()

    def _hold(self, req: EngineRequest) -> None:
        """Keep a finished PD-prefill request's blocks for a decode engine to pull (with a lease)."""
        cfg = self.config
        lease = cfg.kv_lease_seconds
        held = HeldKV(req.request_id, req.blocks, len(req.prompt_ids), time.monotonic() + lease)
        req.blocks = []
        loop = asyncio.get_running_loop()
        held.timer = loop.call_later(lease, self._expire, req.request_id)
        previous = self.held.pop(req.request_id, None)
        self.kv_outstanding += 1
        self._kv_settled.clear()
        if previous is not None:
            # A client reused an X-Request-Id: the older KV can no longer be addressed, free it.
            log.warning("Replaced held KV of a duplicate request id request_id=%s", req.request_id)
            if previous.timer is not None:
                previous.timer.cancel()
            self.release_held(previous)
        self.held[req.request_id] = held
        req.kv_transfer_params_out = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(held.blocks)],
            "remote_engine_id": cfg.engine_id,
            "remote_request_id": req.request_id,
            "remote_host": cfg.side_channel_host,
            "remote_port": cfg.side_channel_port,
            "tp_size": cfg.tensor_parallel_size,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": len(req.prompt_ids),
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": req.num_cached_tokens,
        }

    # ----------------------------------------------------------------------------------------------------
    # The KV store

    async def _store_put(self, hashes: list[int]) -> None:
        """Write a finished prompt's blocks to the store; a failure costs later loads, never this request."""
        assert self.store is not None
        try:
            written = await self.store.put_missing(hashes)
            await self._model_link(written)
        except StoreError as exc:
            self.metrics.store_errors.labels("put").inc()
            log.warning("Failed to put KV blocks into the store blocks=%d: %s", len(hashes), exc)
            return
        if written:
            self.metrics.store_blocks.labels("put").inc(written)

    async def _model_link(self, blocks: int) -> None:
        """The modelled link time of the real model's KV for `blocks` blocks, on top of the real transfer (as the
        side channel adds it to a pull: the payload moved is smaller than the model's KV)."""
        t = self.timing
        if blocks and t.kv_link_bytes_per_second > 0:
            await asyncio.sleep(
                t.kv_model_bytes_per_token * blocks * t.block_size / t.kv_link_bytes_per_second / self.config.speed
            )

    async def preload(self, req: EngineRequest) -> None:
        """Load the blocks of `req`'s prompt the store holds beyond this engine's cache, into the cache.

        Runs before the request is queued. The loaded blocks are registered as cached (free, hashed) so the
        scheduler's prefix lookup takes them as hits; `_take_prefix` counts them as external tokens. If they are
        evicted before the request is admitted (a full cache), the request simply computes them.
        """
        store = self.store
        if store is None:
            return
        bs = self.timing.block_size
        req.hashes = block_hashes(req.prompt_ids, bs)
        usable = req.hashes[: (len(req.prompt_ids) - 1) // bs]  # the last prompt token is always computed
        local = len(self.pool.lookup(usable))
        wanted = usable[local:]
        if not wanted:
            return
        m = self.metrics
        m.external_queries.inc(len(wanted) * bs)
        try:
            found = await store.longest_prefix(wanted)
            if found == 0:
                return
            await store.get(wanted[:found])
            await self._model_link(found)
        except StoreError as exc:
            m.store_errors.labels("get").inc()
            log.warning("Failed to load KV blocks from the store request_id=%s: %s", req.request_id, exc)
            return
        m.store_blocks.labels("get").inc(found)
        m.external_hits.inc(found * bs)
        # The cache may have changed while the store answered: place only what is still missing after the prefix.
        have = len(self.pool.lookup(usable[: local + found]))
        if have < local:
            return  # the local prefix was evicted meanwhile: the loaded blocks would not be reachable
        blocks = self.pool.allocate(local + found - have) if local + found > have else []
        if blocks is None:
            return
        for offset, block in enumerate(blocks):
            self.pool.register(block, usable[have + offset])
        self.pool.release(blocks)
        req.store_tokens = len(blocks) * bs

    # ----------------------------------------------------------------------------------------------------
    # PD decode: pulling remote KV

    def _start_pull(self, req: EngineRequest) -> None:
        req.state = State.WAITING_FOR_REMOTE_KV
        if req.first_scheduled is None:
            req.first_scheduled = time.monotonic()
        self.remote_waiting[req.request_id] = req
        req.pull_task = asyncio.get_running_loop().create_task(self._pull_and_resume(req))

    async def _pull_and_resume(self, req: EngineRequest) -> None:
        m = self.metrics
        local = req.num_computed
        remote_tokens = len(req.prompt_ids) - local
        m.external_queries.inc(remote_tokens)
        error: KVLoadError | None = None
        try:
            if self.pull is None:
                raise KVLoadError("no_side_channel", "this engine has no KV transfer client")
            await self.pull(req)
        except KVLoadError as exc:
            error = exc
        except asyncio.CancelledError:
            return
        if self.remote_waiting.pop(req.request_id, None) is None or req.state is State.FINISHED:
            return
        if error is None:
            m.external_hits.inc(remote_tokens)
            m.tokens_by_source["external_kv_transfer"].inc(remote_tokens)
            req.external_tokens = remote_tokens
            req.kv_loaded = True
            # Every prompt token's KV is here; the last one is recomputed locally to sample the first token.
            req.num_computed = len(req.prompt_ids) - 1
            req.prefill_target = len(req.prompt_ids)
            if req.hashes is not None:
                self._register_blocks(req, len(req.hashes))
                self._flush_events()
        else:
            m.nixl_failed_transfers.inc()
            if error.reason == "kv_compat_mismatch":
                m.kv_compat_mismatch.inc()
            if self.config.kv_load_failure_policy == "fail":
                log.warning(
                    "Failed KV load request_id=%s reason=%s policy=fail: %s", req.request_id, error.reason, error
                )
                self._finish(req, "error", error=f"KV transfer failed ({error.reason}): {error}")
                self._update_gauges()
                return
            log.warning(
                "Failed KV load request_id=%s reason=%s policy=recompute: %s", req.request_id, error.reason, error
            )
            # Recompute: prefill locally from whatever prefix was cached here.
            req.remote_prefill = None
        req.state = State.WAITING
        self.waiting.appendleft(req)
        self._work.set()

    # ----------------------------------------------------------------------------------------------------

    def _update_gauges(self) -> None:
        m = self.metrics
        m.running.set(len(self.running))
        waiting = len(self.waiting) + len(self.remote_waiting)
        m.waiting.set(waiting)
        m.waiting_capacity.set(len(self.waiting))
        m.waiting_remote_kv.set(len(self.remote_waiting))
        m.kv_usage.set(self.pool.usage)

    def snapshot(self) -> dict[str, Any]:
        """Internal state for /sim/state (debugging and tests)."""
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "waiting_for_remote_kv": len(self.remote_waiting),
            "held_kv": len(self.held),
            "free_blocks": self.pool.num_free,
            "num_blocks": self.pool.num_blocks,
            "kv_cache_usage": self.pool.usage,
        }


class _Plan:
    """The work of one engine step."""

    __slots__ = ("decode_batch", "decode_context", "items", "prefill_pairs", "prefill_tokens")

    def __init__(self) -> None:
        self.items: list[tuple[EngineRequest, int, bool]] = []
        self.prefill_tokens = 0
        self.prefill_pairs = 0
        self.decode_batch = 0
        self.decode_context = 0

    def add(self, req: EngineRequest, n: int, prefilling: bool) -> None:
        self.items.append((req, n, prefilling))
        if prefilling:
            self.prefill_tokens += n
            self.prefill_pairs += TimingParams.prefill_pairs(req.num_computed, n)
        else:
            self.decode_batch += 1
            self.decode_context += req.num_computed
