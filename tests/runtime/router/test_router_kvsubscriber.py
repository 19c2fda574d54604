"""One subscription against a publisher on real ZMQ sockets (loopback), driven batch by batch: late join, lost
batches, duplicates, a restarted engine, a replaced pod, malformed bytes, a replay socket that never answers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress

import pytest
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pdserve.api.kvevents import END_SEQ, BlockStored, EventBatch, encode_batch, seq_bytes
from pdserve_dev.testing.net import free_port
from pdserve_runtime.router.endpoints import KvEventSource
from pdserve_runtime.router.kvindex import EngineIndex
from pdserve_runtime.router.kvsubscriber import Subscription


def _batch(seq: int, ts: float | None = None) -> bytes:
    """One stored block whose (engine) hash is `seq + 1`: the index's size counts the batches applied."""
    event = BlockStored((seq + 1,), None, (seq, seq, seq, seq), 4)
    return encode_batch(EventBatch(time.time() if ts is None else ts, (event,), 0))


class Publisher:
    """vLLM's publisher protocol by hand: PUB (topic, seq, payload), ROUTER replay from a buffer."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        pub: int,
        replay: int,
        *,
        answer_replays: bool = True,
        replay_topic: bool = True,
    ) -> None:
        self.pub = context.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{pub}")
        self.router = context.socket(zmq.ROUTER)
        self.router.bind(f"tcp://127.0.0.1:{replay}")
        self.buffer: list[tuple[int, bytes]] = []
        self.replays = 0
        self.topic = b"kv@pod-a"
        self.next_seq = 0
        self._answer = answer_replays
        # vLLM 0.32 answers replays with the topic frame; without it is the older form the router still reads.
        self._replay_topic = replay_topic
        self._task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            self.replays += 1
            if not self._answer:
                continue
            first = int.from_bytes(start, "big")
            for seq, payload in self.buffer:
                if seq >= first:
                    await self.router.send_multipart((client, *self._reply(self.topic, seq_bytes(seq), payload)))
            await self.router.send_multipart((client, *self._reply(b"", END_SEQ, b"")))

    def _reply(self, topic: bytes, seq: bytes, payload: bytes) -> tuple[bytes, ...]:
        return (b"", topic, seq, payload) if self._replay_topic else (b"", seq, payload)

    async def publish_next(self) -> None:
        """Publish the next batch of an engine's sequence (a test's live traffic)."""
        self.next_seq += 1
        await self.publish(self.next_seq - 1)

    async def publish(self, seq: int, payload: bytes | None = None, *, live: bool = True) -> None:
        payload = payload if payload is not None else _batch(seq)
        self.buffer.append((seq, payload))
        if live:
            await self.pub.send_multipart((self.topic, seq_bytes(seq), payload))

    async def close(self) -> None:
        """Close both sockets and wait for ZMQ's I/O thread to report each listener closed (EVENT_CLOSED): only
        then can a restarted publisher bind the same ports (closing returns before the port is released)."""
        self._task.cancel()
        for socket in (self.pub, self.router):
            if socket.closed:
                continue
            monitor = socket.get_monitor_socket(zmq.EVENT_CLOSED)
            socket.close(linger=0)
            try:
                async with asyncio.timeout(10):
                    while parse_monitor_message(await monitor.recv_multipart())["event"] != zmq.EVENT_CLOSED:
                        pass
            finally:
                monitor.close(linger=0)


@asynccontextmanager
async def following(
    *, answer_replays: bool = True, replay_topic: bool = True
) -> AsyncIterator[tuple[Publisher, Subscription, Callable[[], Publisher]]]:
    context = zmq.asyncio.Context()
    pub_port, replay_port = free_port(), free_port()
    options = {"answer_replays": answer_replays, "replay_topic": replay_topic}
    publishers = [Publisher(context, pub_port, replay_port, **options)]

    def restart() -> Publisher:
        """A new engine process on the same ports (the old one must be closed first)."""
        publishers.append(Publisher(context, pub_port, replay_port, **options))
        return publishers[-1]

    index = EngineIndex()
    source = KvEventSource(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}")
    sub = Subscription(source, index, context, replay_timeout=1.0)
    sub.start()
    try:
        yield publishers[0], sub, restart
    finally:
        await sub.stop()
        for publisher in publishers:
            await publisher.close()
        context.destroy(linger=0)


async def until(
    condition: Callable[[], bool], sub: Subscription, *, publish: Callable[[], object] | None = None
) -> None:
    """Wait (10 s at most) for `condition`, re-checking after each applied batch or a short poll; on timeout, fail
    with what the subscription saw."""
    try:
        async with asyncio.timeout(10):
            while not condition():
                if publish is not None:
                    await publish()  # type: ignore[misc]
                sub.applied.clear()
                with suppress(TimeoutError):
                    await asyncio.wait_for(sub.applied.wait(), 0.2)
    except TimeoutError:
        raise AssertionError(f"condition not met in 10 s: last_seq={sub.last_seq} {sub.stats}") from None


def live_batches(sub: Subscription) -> int:
    """Batches applied as they arrived on the SUB socket. A SUB socket reports itself connected before the
    publisher has its subscription (ZMQ's slow joiner): until one live batch was applied, a single batch sent
    may be dropped, so the tests send one-off batches only after this counts one."""
    return sub.stats.batches - sub.stats.replayed_batches


@pytest.mark.parametrize("replay_topic", [True, False], ids=["vllm-0.32-reply", "reply-without-topic"])
async def test_a_late_subscriber_replays_what_it_missed(replay_topic: bool) -> None:
    async with following(replay_topic=replay_topic) as (publisher, sub, _):
        for seq in range(5):
            await publisher.publish(seq)  # nobody was subscribed yet: lost on PUB, kept for replay
        await until(lambda: sub.last_seq == 4, sub)
        assert sub.stats.replays >= 1 and sub.stats.replayed_batches == 5
        publisher.next_seq = 5
        await until(lambda: live_batches(sub) >= 1, sub, publish=publisher.publish_next)
        assert sub.last_seq is not None and len(sub.index) == sub.last_seq + 1  # every batch applied once


async def test_lost_batches_are_replayed_and_duplicates_skipped() -> None:
    async with following() as (publisher, sub, _):
        await until(lambda: live_batches(sub) >= 1, sub, publish=publisher.publish_next)
        start = publisher.next_seq
        await publisher.publish(start, live=False)  # lost on the way (a full queue, a dropped connection)
        await publisher.publish(start + 1)
        await until(lambda: sub.last_seq == start + 1, sub)
        assert sub.stats.gaps >= 1
        assert len(sub.index) == start + 2  # every batch applied once, the lost one from the replay
        # A batch seen again with its old timestamp (a replay overlapping live traffic) is a duplicate.
        old_seq, old_payload = publisher.buffer[start]
        await publisher.pub.send_multipart((publisher.topic, seq_bytes(old_seq), old_payload))
        await publisher.publish(start + 2)
        await until(lambda: sub.last_seq == start + 2, sub)
        assert sub.stats.duplicates == 1 and sub.stats.restarts == 0


async def test_a_restarted_engine_clears_the_index() -> None:
    async with following() as (publisher, sub, restart):
        await until(lambda: (sub.last_seq or 0) >= 3, sub, publish=publisher.publish_next)
        await publisher.close()
        fresh = restart()
        # The new process numbers from 0 again and has an empty cache: its first block is hash 1000.
        await until(
            lambda: sub.stats.restarts >= 1 and len(sub.index) == 1,
            sub,
            publish=lambda: fresh.publish(0, _batch(999)) if not fresh.buffer else asyncio.sleep(0),
        )
        assert sub.index.mask(next(iter(sub.index._mask))) == 1


async def test_a_sequence_starting_again_without_a_reconnect_is_a_restart() -> None:
    """An engine restarted behind the same connection (nothing for the socket monitor to see): its sequence
    starts again with later timestamps."""
    async with following() as (publisher, sub, _):
        await until(lambda: (sub.last_seq or 0) >= 3, sub, publish=publisher.publish_next)
        publisher.buffer.clear()
        await until(
            lambda: sub.stats.restarts >= 1 and len(sub.index) == 1,
            sub,
            publish=lambda: publisher.publish(0, _batch(999)) if not publisher.buffer else asyncio.sleep(0),
        )


async def test_a_new_topic_is_a_new_pod() -> None:
    async with following() as (publisher, sub, _):
        await until(lambda: (sub.last_seq or 0) >= 2, sub, publish=publisher.publish_next)
        publisher.topic = b"kv@pod-b"
        publisher.buffer.clear()
        await until(lambda: sub.stats.restarts == 1, sub, publish=lambda: publisher.publish(0, _batch(50)))
        await until(lambda: len(sub.index) >= 1 and sub.last_seq == 0, sub)


async def test_malformed_bytes_cost_one_batch() -> None:
    async with following() as (publisher, sub, _):
        await until(lambda: live_batches(sub) >= 1, sub, publish=publisher.publish_next)
        await publisher.pub.send_multipart((publisher.topic, seq_bytes(publisher.next_seq), b"\xc1garbage"))
        await publisher.pub.send_multipart((publisher.topic, b"short"))
        await until(lambda: sub.stats.malformed >= 2, sub)
        await publisher.publish_next()  # the subscription goes on (a replay fills what the garbage stood for)
        await until(lambda: sub.last_seq == publisher.next_seq - 1, sub)


async def test_without_replay_answers_live_batches_are_still_followed() -> None:
    async with following(answer_replays=False) as (publisher, sub, _):
        await until(lambda: len(sub.index) >= 3, sub, publish=publisher.publish_next)
        assert sub.stats.replay_failures >= 1
