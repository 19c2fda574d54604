"""vLLM's KV-cache event wire format (`--kv-events-config`), shared by the engine simulator (which publishes it)
and the router (which indexes it).

What vLLM 0.32 sends (`vllm/distributed/kv_events.py`, `ZmqEventPublisher`), and what this module reads and writes:

- The publisher's PUB socket sends one multipart message per engine step that changed the cache:
  `(topic, sequence, payload)`. `topic` is the configured topic's UTF-8 bytes; `sequence` is an 8-byte big-endian
  unsigned counter starting at 0 for every engine process; `payload` is one msgpack-encoded batch.
- A batch is a msgpack *array* `[ts, events, data_parallel_rank]` (msgspec `array_like`: every field is written,
  the rank as nil when unset; the publisher sets its rank, 0 without data parallelism). A two-item array (older
  releases) is read too. `ts` is the publisher's wall-clock time (float seconds).
- Each event is a msgpack *map* tagged by its class name under the key `"type"` (msgspec `tag=True`, not
  array-like): `{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h | nil, "token_ids": [...],
  "block_size": n, "lora_id": n | nil, "medium": "GPU" | "CPU" | ... | nil, "lora_name": s | nil, ...}`,
  `{"type": "BlockRemoved", "block_hashes": [...], "medium": ...}`, `{"type": "AllBlocksCleared"}`. Fields with a
  default are omitted when they hold it (`extra_keys`, `group_idx`, `kv_cache_spec_*`, `locality`, `ownership`,
  `session_id`); unknown keys are ignored here, so a newer vLLM's additions do not break the reader.
- A block hash is bytes (vLLM's default sha256-based hashes, 32 bytes) or an unsigned 64-bit integer (with
  `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`). The reader keeps whichever it gets; the simulator sends integers.
- A `BlockStored` names `len(block_hashes)` consecutive full blocks of one request: block i holds
  `token_ids[i * block_size:(i + 1) * block_size]`, and the first block's parent is `parent_block_hash` (nil for
  the first block of a prompt). So a reader can rebuild which token prefix each block hash stands for without
  knowing the engine's hash function or its seed: that is how the router matches prompts (`kvindex`).
- `medium` says where the block lives: `GPU` for the engine's own block pool, `CPU` / other names for offloading
  tiers that publish through the same stream. nil means the GPU pool (older releases had no field).
- Replay (the publisher's ROUTER socket): a subscriber's DEALER sends `(b"", start)` with `start` an 8-byte
  big-endian sequence number; the publisher answers every buffered batch with a sequence >= `start` as
  `(b"", topic, sequence, payload)`, then `(b"", b"", END_SEQ, b"")` where END_SEQ is -1 as a signed 8-byte
  integer (`ZmqEventPublisher._service_replay`). The buffer holds the last `buffer_steps` batches (10,000 by
  default). `replay_frames` also reads the reply without the topic frame, `(b"", sequence, payload)`, which
  pdserve's simulator sent until the real-engine tier ran the router against vLLM 0.32's publisher and found
  every replay unanswered (tests/realvllm/test_kvevents_real.py).
- With data parallelism every rank publishes on its own port: the configured port plus the rank, for both the
  publisher and the replay endpoint.

`decode_batch` validates every field it uses and raises `WireError` with the reason for anything else: events come
from engines over the network and a malformed one must cost one batch, never the router.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

BlockHash = bytes | int
"""An engine's block hash as it appears on the wire."""

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"

#: The replay socket's end-of-replay marker: -1 as a signed 8-byte big-endian integer.
END_SEQ = (-1).to_bytes(8, "big", signed=True)

# Bounds on what one batch may hold (a batch is one engine step; these are far above any real step).
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024
_MAX_HASH_BYTES = 64
_U64 = (1 << 64) - 1


class WireError(ValueError):
    """A message that is not vLLM's KV-event format."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive full blocks of one request entered a cache tier."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    has_extra_keys: bool = False
    """Whether any block's hash also covers extra keys (multimodal inputs, a cache salt, a LoRA name)."""
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks left a cache tier (evicted)."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache (vLLM's reset_prefix_cache)."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """The events of one engine step."""

    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None = None


# ------------------------------------------------------------------------------------------------------ encoding


def _stored_map(event: BlockStored) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": list(event.block_hashes),
        "parent_block_hash": event.parent_block_hash,
        "token_ids": list(event.token_ids),
        "block_size": event.block_size,
        "lora_id": event.lora_id,
        "medium": event.medium,
        "lora_name": event.lora_name,
    }
    if event.group_idx is not None:
        out["group_idx"] = event.group_idx
    return out


def _event_map(event: Event) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        return _stored_map(event)
    if isinstance(event, BlockRemoved):
        out: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": event.medium}
        if event.group_idx is not None:
            out["group_idx"] = event.group_idx
        return out
    return {"type": "AllBlocksCleared"}


def encode_batch(batch: EventBatch) -> bytes:
    """The msgpack payload of a batch, laid out as vLLM's msgspec encoder lays it out."""
    fields = [batch.ts, [_event_map(event) for event in batch.events], batch.data_parallel_rank]
    return msgpack.packb(fields, use_bin_type=True)


def seq_bytes(seq: int) -> bytes:
    """A sequence number as the 8-byte big-endian frame."""
    return seq.to_bytes(8, "big")


# ------------------------------------------------------------------------------------------------------ decoding


@dataclass(frozen=True, slots=True)
class ReplayFrame:
    """One message of a replay reply, its leading empty delimiter removed; `seq` -1 ends the reply."""

    topic: bytes | None
    seq: int
    payload: bytes


def replay_frames(topic: bytes, seq: int, payload: bytes) -> tuple[bytes, bytes, bytes, bytes]:
    """A replay reply message as vLLM 0.32 sends it (after the ROUTER's client id): the delimiter, the topic, the
    sequence, the payload (`END_SEQ` with an empty topic and payload ends the reply)."""
    return (b"", topic, seq_bytes(seq) if seq >= 0 else END_SEQ, payload)


def parse_replay(frames: Sequence[bytes]) -> ReplayFrame:
    """A replay reply message as a DEALER receives it: `(b"", topic, seq, payload)` (vLLM 0.32) or
    `(b"", seq, payload)` (no topic); `WireError` for anything else."""
    if len(frames) == 4 and frames[0] == b"":
        return ReplayFrame(frames[1], parse_seq(frames[2]), frames[3])
    if len(frames) == 3 and frames[0] == b"":
        return ReplayFrame(None, parse_seq(frames[1]), frames[2])
    raise WireError(f"replay message of {len(frames)} frames (want an empty delimiter, then topic, seq, payload)")


def parse_seq(frame: bytes) -> int:
    """A sequence frame as an integer; END_SEQ reads as -1."""
    if len(frame) != 8:
        raise WireError(f"sequence frame of {len(frame)} bytes (want 8)")
    return int.from_bytes(frame, "big", signed=True)


def _hash(value: object, what: str) -> BlockHash:
    if isinstance(value, bytes) and 0 < len(value) <= _MAX_HASH_BYTES:
        return value
    if type(value) is int and 0 <= value <= _U64:
        return value
    raise WireError(f"{what} is not a block hash (bytes or unsigned 64-bit integer)")


def _hashes(value: object) -> tuple[BlockHash, ...]:
    if not isinstance(value, list):
        raise WireError("block_hashes is not a list")
    return tuple(_hash(item, "block_hashes item") for item in value)


def _optional_str(event: dict[Any, Any], key: str) -> str | None:
    value = event.get(key)
    if value is None or isinstance(value, str):
        return value
    raise WireError(f"{key} is not a string")


def _optional_int(event: dict[Any, Any], key: str) -> int | None:
    value = event.get(key)
    if value is None or type(value) is int:
        return value
    raise WireError(f"{key} is not an integer")


def _stored(event: dict[Any, Any]) -> BlockStored:
    hashes = _hashes(event.get("block_hashes"))
    parent = event.get("parent_block_hash")
    block_size = event.get("block_size")
    if type(block_size) is not int or block_size <= 0:
        raise WireError("block_size is not a positive integer")
    tokens = event.get("token_ids")
    if not isinstance(tokens, list) or not all(type(token) is int for token in tokens):
        raise WireError("token_ids is not a list of integers")
    if len(tokens) != len(hashes) * block_size:
        raise WireError(f"{len(tokens)} token ids for {len(hashes)} blocks of {block_size}")
    extra = event.get("extra_keys")
    if extra is not None and not isinstance(extra, list):
        raise WireError("extra_keys is not a list")
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None if parent is None else _hash(parent, "parent_block_hash"),
        token_ids=tuple(tokens),
        block_size=block_size,
        lora_id=_optional_int(event, "lora_id"),
        medium=_optional_str(event, "medium"),
        lora_name=_optional_str(event, "lora_name"),
        has_extra_keys=any(item for item in extra or ()),
        group_idx=_optional_int(event, "group_idx"),
    )


def _event(raw: object) -> Event | None:
    """One event, or None for an event type this reader does not know (skipped, as msgspec's would fail)."""
    if not isinstance(raw, dict):
        raise WireError("event is not a map")
    kind = raw.get("type")
    if kind == "BlockStored":
        return _stored(raw)
    if kind == "BlockRemoved":
        return BlockRemoved(
            block_hashes=_hashes(raw.get("block_hashes")),
            medium=_optional_str(raw, "medium"),
            group_idx=_optional_int(raw, "group_idx"),
        )
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    if isinstance(kind, str):
        return None
    raise WireError("event has no type tag")


def decode_batch(payload: bytes) -> EventBatch:
    """A batch from its msgpack payload; `WireError` says what is wrong with anything else."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise WireError(f"batch of {len(payload)} bytes is over the {MAX_PAYLOAD_BYTES} byte bound")
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        # TypeError: a map whose key is a map or an array (unhashable in Python), e.g. b"\x83\x00\x00\x00\x00\x80\x00".
        raise WireError(f"not msgpack: {exc}") from None
    if not isinstance(raw, list) or len(raw) not in (2, 3):
        raise WireError("batch is not an array of 2 or 3 items [ts, events, data_parallel_rank]")
    ts, events = raw[0], raw[1]
    if type(ts) not in (float, int):
        raise WireError("batch ts is not a number")
    if not isinstance(events, list):
        raise WireError("batch events is not a list")
    rank = raw[2] if len(raw) == 3 else None
    if rank is not None and type(rank) is not int:
        raise WireError("data_parallel_rank is not an integer")
    decoded = [_event(item) for item in events]
    return EventBatch(float(ts), tuple(event for event in decoded if event is not None), rank)


def block_tokens(event: BlockStored) -> Sequence[tuple[BlockHash, tuple[int, ...]]]:
    """Each stored block's hash with the token ids it holds."""
    size = event.block_size
    tokens = event.token_ids
    return [(block, tokens[i * size : (i + 1) * size]) for i, block in enumerate(event.block_hashes)]
