"""One subscription to one engine publisher's KV events: a ZMQ SUB socket for live batches and the publisher's
replay socket for what the SUB missed, feeding an `EngineIndex`.

Sequence numbers are the whole delivery protocol (`pdserve.api.kvevents`): a publisher numbers its batches from 0
and keeps the last few thousand for replay. The subscription applies batch `last + 1` and otherwise works out what
happened from the sequence and the batch's timestamp:

- `seq > last + 1`: batches were lost (the SUB's queue overflowed, or the connection dropped and came back):
  replay from `last`.
- `seq <= last` with a timestamp not after the last applied one: a duplicate (a replay overlapping live traffic):
  skipped.
- `seq <= last` with a later timestamp: the engine restarted (a new process numbers from 0 again): its cache is
  empty, so the index is cleared and rebuilt from a replay from 0.
- a different topic: the pod was replaced (the renderer puts the pod's name and UID in the topic): same as a restart.
- the SUB socket (re)connected (ZMQ's socket monitor): a restarted engine may not have published yet, so replay
  from `last` and compare: if the publisher still has batch `last` with the same timestamp, this is the same
  incarnation and only newer batches are applied; otherwise it is a new one and everything is rebuilt from 0.

A replay is one DEALER request (a fresh socket each time, so a late answer to an abandoned request is never read
as the answer to a new one), bounded by `replay_timeout`; without an answer the subscription goes on with live
batches and tries again at the next trigger, after a backoff. A publisher without a replay endpoint is followed
live only (its index may miss blocks, never invent them).

Malformed batches (`WireError`) are counted and skipped; nothing an engine sends can stop the subscription or the
router. Everything runs on the router's event loop (pyzmq's asyncio sockets); applying one batch is a few
microseconds per block.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import zmq
import zmq.asyncio

from pdserve.api.kvevents import EventBatch, WireError, decode_batch, parse_replay, parse_seq, seq_bytes
from pdserve_runtime.router.endpoints import KvEventSource
from pdserve_runtime.router.kvindex import EngineIndex

log = logging.getLogger("pdserve.router.kvevents")

# How many queued batches are handled before the loop lets other work run.
_BATCHES_PER_TURN = 64
_MAX_BACKOFF = 30.0


@dataclass(slots=True)
class SubscriptionStats:
    """Counts a subscription keeps (exported as metrics by the hub)."""

    batches: int = 0
    duplicates: int = 0
    malformed: int = 0
    gaps: int = 0
    restarts: int = 0
    replays: int = 0
    replay_failures: int = 0
    replayed_batches: int = 0
    last_error: str = ""


class Subscription:
    """Follows one publisher into one `EngineIndex`."""

    def __init__(
        self,
        source: KvEventSource,
        index: EngineIndex,
        context: zmq.asyncio.Context,
        *,
        label: str = "",
        replay_timeout: float = 5.0,
    ) -> None:
        self.source = source
        self.index = index
        self.label = label or source.endpoint
        self.stats = SubscriptionStats()
        self._context = context
        self._replay_timeout = replay_timeout
        self._last_seq: int | None = None
        self._last_ts = 0.0
        self._topic: bytes | None = None
        self._resync = False
        self._backoff = 0.5
        self._resync_at = 0.0  # no replay before this (loop time): the backoff after an unanswered one
        self._replay_failed = False
        self._task: asyncio.Task[None] | None = None
        #: Set whenever a batch was applied (tests and benchmarks wait on it instead of sleeping).
        self.applied = asyncio.Event()

    @property
    def last_seq(self) -> int | None:
        return self._last_seq

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"pdserve-kv-events {self.label}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    # -- the loop ---------------------------------------------------------------------------------------------

    async def _run(self) -> None:
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED)
        try:
            sub.connect(self.source.endpoint)
            poller = zmq.asyncio.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            loop = asyncio.get_running_loop()
            while True:
                if self._resync and loop.time() >= self._resync_at:
                    await self._replay()
                ready = dict(await poller.poll(timeout=1000))
                if monitor in ready:
                    await monitor.recv_multipart()  # (event id + value, endpoint): only CONNECTED is monitored
                    self._resync = True
                if sub in ready:
                    for _ in range(_BATCHES_PER_TURN):
                        try:
                            frames = await sub.recv_multipart(flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_live(frames)
                        if self._resync:
                            break
        except zmq.ZMQError as exc:
            # A malformed endpoint (bad discovery data) or a closed context: nothing to follow.
            log.error("Stopped following KV events endpoint=%s: %s", self.source.endpoint, exc)
            self.stats.last_error = str(exc)
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    def _on_live(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self.stats.malformed += 1
            return
        topic, seq_frame, payload = frames
        try:
            seq = parse_seq(seq_frame)
            batch = decode_batch(payload)
        except WireError as exc:
            self._malformed(exc)
            return
        if self._topic is not None and topic != self._topic:
            log.info("Saw a new KV event publisher incarnation endpoint=%s topic=%r", self.source.endpoint, topic)
            self._new_incarnation()
            self._topic = topic
            self._resync = True
            return
        self._topic = topic
        last = self._last_seq
        if last is None or seq == last + 1:
            if last is None and seq > 0 and self.source.replay_endpoint is not None and not self._replay_failed:
                self._resync = True  # joined late: the batches before this one are in the replay buffer
                return
            self._apply(seq, batch.ts, batch)
        elif seq <= last:
            if batch.ts <= self._last_ts:
                self.stats.duplicates += 1
                return
            log.info("Saw a KV event publisher restart endpoint=%s seq=%d last=%d", self.source.endpoint, seq, last)
            self._new_incarnation()
            self._resync = True
        else:
            self.stats.gaps += 1
            self._resync = True

    def _apply(self, seq: int, ts: float, batch: EventBatch) -> None:
        self.index.apply(batch)
        self._last_seq = seq
        self._last_ts = ts
        self.stats.batches += 1
        self.applied.set()

    def _new_incarnation(self) -> None:
        self.stats.restarts += 1
        self.index.clear()
        self._last_seq = None
        self._last_ts = 0.0

    def _malformed(self, exc: WireError) -> None:
        self.stats.malformed += 1
        self.stats.last_error = str(exc)
        if self.stats.malformed == 1 or self.stats.malformed % 1000 == 0:
            log.warning("Skipped a malformed KV event batch endpoint=%s count=%d: %s", self.source.endpoint,
                        self.stats.malformed, exc)  # fmt: skip

    # -- replay -----------------------------------------------------------------------------------------------

    async def _replay(self) -> None:
        """Bring the index up to the publisher's present from its replay buffer (module docstring)."""
        self._resync = False
        if self.source.replay_endpoint is None:
            return
        self.stats.replays += 1
        last = self._last_seq
        start = last if last is not None else 0
        batches = await self._fetch(start)
        if batches is None:
            return
        if last is not None:
            first = batches[0] if batches else None
            if first is None or first[0] != last or first[1] != self._last_ts:
                log.info("Found a new KV event publisher incarnation on replay endpoint=%s", self.source.endpoint)
                self._new_incarnation()
                if start > 0:
                    again = await self._fetch(0)
                    if again is None:
                        return
                    batches = again
        for seq, ts, batch in batches:
            if self._last_seq is None or seq > self._last_seq:
                self._apply(seq, ts, batch)
                self.stats.replayed_batches += 1
        self._backoff = 0.5
        self._replay_failed = False

    async def _fetch(self, start: int) -> list[tuple[int, float, EventBatch]] | None:
        """Every buffered batch from `start` on, decoded; None when the publisher did not answer in time."""
        assert self.source.replay_endpoint is not None
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, float, EventBatch]] = []
        try:
            dealer.connect(self.source.replay_endpoint)
            await dealer.send_multipart((b"", seq_bytes(start)))
            async with asyncio.timeout(self._replay_timeout):
                while True:
                    frames = await dealer.recv_multipart()
                    try:
                        message = parse_replay(frames)
                        if message.seq < 0:
                            return out
                        batch = decode_batch(message.payload)
                        seq = message.seq
                    except WireError as exc:
                        self._malformed(exc)
                        continue
                    out.append((seq, batch.ts, batch))
        except (TimeoutError, zmq.ZMQError) as exc:
            self.stats.replay_failures += 1
            self.stats.last_error = f"replay: {exc or 'no answer'}"
            log.warning("Got no KV event replay endpoint=%s start=%d (retrying in %.1fs)",
                        self.source.replay_endpoint, start, self._backoff)  # fmt: skip
            # Follow live batches meanwhile, and ask again after the backoff.
            self._replay_failed = True
            self._resync = True
            self._resync_at = asyncio.get_running_loop().time() + self._backoff
            self._backoff = min(self._backoff * 2, _MAX_BACKOFF)
            return None
        finally:
            dealer.close(linger=0)
