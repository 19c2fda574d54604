"""KV-cache events as vLLM publishes them (`--kv-events-config`), from the simulator's real prefix cache.

The block pool (`kvcache.BlockPool`) reports each block it registers or evicts to a `KvEventRecorder`; the engine
flushes the recorder once per scheduler step into one batch, as vLLM's scheduler does (`take_events()` after each
step, published when non-empty). The publisher sends batches in vLLM's wire format (`pdserve.api.kvevents`) from a
thread of its own, like vLLM's `ZmqEventPublisher`: a PUB socket (topic, sequence, payload), and when a replay
endpoint is configured a ROUTER socket answering replay requests from a buffer of the last `buffer_steps` batches.
The thread keeps ZMQ off the simulator's event loop (zmq sockets are not thread-safe: only the thread touches
them; the loop hands batches over through a queue).

Block hashes on the wire are the pool's own 64-bit chained hashes as unsigned integers (vLLM's
`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` form), blocks are stored on the `GPU` medium.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from pdserve.api.kvevents import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    encode_batch,
    replay_frames,
    seq_bytes,
)

log = logging.getLogger("pdserve.sim.kvevents")

_U64 = (1 << 64) - 1


def wire_hash(block_hash: int) -> int:
    """The pool's signed Python hash as the unsigned 64-bit integer vLLM's int form carries."""
    return block_hash & _U64


@dataclass(frozen=True, slots=True)
class KvEventsConfig:
    """vLLM's KVEventsConfig fields the simulator models (same names, same defaults)."""

    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000

    @classmethod
    def from_vllm(cls, raw: dict[str, Any]) -> KvEventsConfig | None:
        """The config a `--kv-events-config` JSON object asks for; None when events are off."""
        if not raw.get("enable_kv_cache_events"):
            return None
        publisher = raw.get("publisher") or "zmq"
        if publisher == "null":
            return None
        if publisher != "zmq":
            raise ValueError(f"unknown KV event publisher {publisher!r} (the simulator has zmq and null)")
        defaults = cls()
        return cls(
            endpoint=str(raw.get("endpoint") or defaults.endpoint),
            replay_endpoint=str(raw["replay_endpoint"]) if raw.get("replay_endpoint") else None,
            topic=str(raw.get("topic") or ""),
            buffer_steps=int(raw.get("buffer_steps") or defaults.buffer_steps),
            hwm=int(raw.get("hwm") or defaults.hwm),
        )


def bind_address(endpoint: str, bind_host: str | None) -> str:
    """Where to bind `endpoint`: a wildcard host becomes `bind_host` (the pod's address on the process node, where
    pods share one network namespace), anything else is kept."""
    if bind_host and endpoint.startswith("tcp://*:"):
        host = f"[{bind_host}]" if ":" in bind_host else bind_host
        return f"tcp://{host}:{endpoint.rsplit(':', 1)[1]}"
    return endpoint


class KvEventRecorder:
    """Collects the block pool's changes between two steps."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[Event] = []
        # Consecutive stores of one request are merged into one BlockStored, as vLLM's cache_full_blocks does.
        self._run: tuple[list[int], int | None, list[int]] | None = None

    def stored(self, block_hash: int, parent: int | None, token_ids: Sequence[int]) -> None:
        run = self._run
        if run is not None and run[0][-1] == parent:
            run[0].append(block_hash)
            run[2].extend(token_ids)
            return
        self._close_run()
        self._run = ([block_hash], parent, list(token_ids))

    def removed(self, block_hash: int) -> None:
        self._close_run()
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            self._events[-1] = BlockRemoved((*last.block_hashes, wire_hash(block_hash)), MEDIUM_GPU)
        else:
            self._events.append(BlockRemoved((wire_hash(block_hash),), MEDIUM_GPU))

    def cleared(self) -> None:
        self._run = None
        self._events = [AllBlocksCleared()]

    def take(self) -> list[Event]:
        """The events since the last take, in order."""
        self._close_run()
        events, self._events = self._events, []
        return events

    def _close_run(self) -> None:
        run = self._run
        if run is None:
            return
        self._run = None
        hashes, parent, tokens = run
        self._events.append(
            BlockStored(
                block_hashes=tuple(wire_hash(value) for value in hashes),
                parent_block_hash=None if parent is None else wire_hash(parent),
                token_ids=tuple(tokens),
                block_size=self.block_size,
                medium=MEDIUM_GPU,
            )
        )


class KvEventPublisher:
    """vLLM's ZMQ publisher: PUB for live batches, ROUTER for replay, one thread owning both."""

    def __init__(self, config: KvEventsConfig, bind_host: str | None = None) -> None:
        self.config = config
        self._queue: queue.Queue[EventBatch | None] = queue.Queue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket[bytes] | None = None
        self.published = 0
        try:
            self._pub.bind(bind_address(config.endpoint, bind_host))
            if config.replay_endpoint:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(bind_address(config.replay_endpoint, bind_host))
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="pdserve-sim-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[Event]) -> None:
        """Queue one step's events (called on the event loop; never blocks)."""
        if events:
            self._queue.put(EventBatch(time.time(), tuple(events), data_parallel_rank=0))

    def close(self) -> None:
        """Send what is queued, then stop the thread and close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout=5.0)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._context.term()

    def _run(self) -> None:
        seq = 0
        replay = self._replay
        while True:
            if replay is not None:
                while replay.poll(0):
                    self._serve_replay(replay)
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = encode_batch(batch)
            try:
                self._pub.send_multipart((self._topic, seq_bytes(seq), payload))
            except zmq.ZMQError:
                log.exception("Failed to publish KV events seq=%d", seq)
            self._buffer.append((seq, payload))
            seq += 1
            self.published = seq

    def _serve_replay(self, replay: zmq.Socket[bytes]) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("Ignored a malformed KV event replay request frames=%d", len(frames))
            return
        client, _, start_frame = frames
        start = int.from_bytes(start_frame, "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                replay.send_multipart((client, *replay_frames(self._topic, seq, payload)))
        replay.send_multipart((client, *replay_frames(b"", -1, b"")))
