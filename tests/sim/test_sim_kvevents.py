"""The simulator publishes its real prefix cache in vLLM's KV-event format: stored blocks with their token ids
and parent chain, evictions, replay; `serve ... --kv-events-config` as the renderer writes it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
import zmq
import zmq.asyncio

from pdserve.api.kvevents import (
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    parse_replay,
    seq_bytes,
)
from pdserve_dev.testing.net import free_port
from pdserve_dev.testing.sim import sim_server_in_process, wait_healthy
from pdserve_dev.testing.wait import wait_for_async
from pdserve_sim.kvcache import block_hashes
from pdserve_sim.kvevents import KvEventsConfig, bind_address, wire_hash
from pdserve_sim.presets import FAST
from pdserve_sim.server import SimServer
from pdserve_sim.tokenizer import tokenize
from tests.sim.test_sim_cli import pdserve

pytestmark = pytest.mark.timeout(60)


async def _batches(
    context: zmq.asyncio.Context, server: SimServer, count: int, start: int = 0
) -> list[tuple[int, EventBatch]]:
    """Batches `start` .. `start + count - 1`, once published, read back through the replay socket (the same bytes
    the PUB socket sent; reading them there needs no race against the subscription's propagation)."""
    publisher = server.kv_publisher
    assert publisher is not None and publisher.config.replay_endpoint is not None
    await _published(server, start + count)
    dealer = context.socket(zmq.DEALER)
    dealer.connect(publisher.config.replay_endpoint)
    out = []
    try:
        await dealer.send_multipart((b"", seq_bytes(start)))
        async with asyncio.timeout(10):
            while True:
                message = parse_replay(await dealer.recv_multipart())
                if message.seq < 0:
                    break
                assert message.topic == publisher.config.topic.encode()  # vLLM 0.32's reply carries the topic
                out.append((message.seq, decode_batch(message.payload)))
    finally:
        dealer.close(linger=0)
    return out[:count]


async def _published(server: SimServer, count: int) -> None:
    """Wait until the publisher thread has sent `count` batches (a counter in another thread: polled, bounded)."""

    async def done() -> bool | None:
        return (server.kv_publisher is not None and server.kv_publisher.published >= count) or None

    await wait_for_async(done, within=10, interval=0.01, message=f"{count} batches published")


def _config(topic: str = "") -> KvEventsConfig:
    return KvEventsConfig(
        endpoint=f"tcp://127.0.0.1:{free_port()}", replay_endpoint=f"tcp://127.0.0.1:{free_port()}", topic=topic
    )


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


async def _complete(url: str, prompt: str, model: str = "sim-model") -> None:
    async with aiohttp.ClientSession() as session:
        body = {"model": model, "prompt": prompt, "max_tokens": 2}
        async with session.post(url + "/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()


async def test_stored_blocks_carry_the_prompts_tokens_and_chain(context: zmq.asyncio.Context) -> None:
    async with sim_server_in_process(kv_events=_config(topic="kv@sim")) as server:
        prompt = " ".join(f"word{i}" for i in range(100))
        await _complete(f"http://127.0.0.1:{server.http_port}", prompt)
        [(seq, batch)] = await _batches(context, server, 1)
        assert seq == 0 and batch.data_parallel_rank == 0
        ids = tokenize(prompt)
        size = FAST.block_size
        expected = [wire_hash(h) for h in block_hashes(ids, size)]
        stored = [e for e in batch.events if isinstance(e, BlockStored)]
        assert [h for e in stored for h in e.block_hashes] == expected
        assert [t for e in stored for t in e.token_ids] == ids[: len(expected) * size]
        assert stored[0].parent_block_hash is None and stored[0].medium == "GPU"
        # Its prefix again: nothing new enters the cache, so nothing is published (vLLM publishes only changes).
        await _complete(f"http://127.0.0.1:{server.http_port}", prompt)
        await _complete(f"http://127.0.0.1:{server.http_port}", prompt + " tail" * 30)  # two more full blocks
        [(seq, batch)] = await _batches(context, server, 1, start=1)
        [tail] = [e for e in batch.events if isinstance(e, BlockStored)]
        assert seq == 1 and tail.parent_block_hash == expected[-1]


async def test_evictions_are_published(context: zmq.asyncio.Context) -> None:
    timing = FAST.with_overrides(num_kv_blocks=12)
    async with sim_server_in_process(kv_events=_config(), timing=timing) as server:
        url = f"http://127.0.0.1:{server.http_port}"
        first = " ".join(f"one{i}" for i in range(100))  # 100 tokens: 6 full blocks of 16, 7 allocated
        await _complete(url, first)
        await _complete(url, " ".join(f"two{i}" for i in range(100)))  # needs blocks the first prompt's cache holds
        batches = await _batches(context, server, 2)
        removed = [h for _, b in batches for e in b.events if isinstance(e, BlockRemoved) for h in e.block_hashes]
        cached = {wire_hash(h) for h in block_hashes(tokenize(first), 16)}
        assert removed and set(removed) <= cached


async def test_replay_answers_from_the_buffer(context: zmq.asyncio.Context) -> None:
    events = KvEventsConfig(
        endpoint=f"tcp://127.0.0.1:{free_port()}", replay_endpoint=f"tcp://127.0.0.1:{free_port()}", buffer_steps=2
    )
    async with sim_server_in_process(kv_events=events) as server:
        url = f"http://127.0.0.1:{server.http_port}"
        for index in range(3):
            await _complete(url, " ".join(f"p{index}w{i}" for i in range(40)))
        assert server.kv_publisher is not None
        await _published(server, 3)
        dealer = context.socket(zmq.DEALER)
        assert events.replay_endpoint is not None
        dealer.connect(events.replay_endpoint)
        await dealer.send_multipart((b"", seq_bytes(0)))
        answers = []
        async with asyncio.timeout(5):
            while True:
                frames = await dealer.recv_multipart()
                assert len(frames) == 4, frames  # vLLM 0.32: delimiter, topic, sequence, payload
                message = parse_replay(frames)
                answers.append(message.seq)
                if answers[-1] == -1:
                    assert message.payload == b"" and message.topic == b""
                    break
                decode_batch(message.payload)
        assert answers == [1, 2, -1]  # the buffer keeps the last two batches
        dealer.close(linger=0)


def test_wildcard_endpoints_bind_the_pods_address() -> None:
    assert bind_address("tcp://*:5557", "10.0.0.7") == "tcp://10.0.0.7:5557"
    assert bind_address("tcp://*:5557", "fd00::7") == "tcp://[fd00::7]:5557"
    assert bind_address("tcp://*:5557", None) == "tcp://*:5557"
    assert bind_address("tcp://127.0.0.1:5557", "10.0.0.7") == "tcp://127.0.0.1:5557"


def test_the_vllm_config_object() -> None:
    assert KvEventsConfig.from_vllm({"enable_kv_cache_events": False}) is None
    assert KvEventsConfig.from_vllm({"enable_kv_cache_events": True, "publisher": "null"}) is None
    config = KvEventsConfig.from_vllm({"enable_kv_cache_events": True, "endpoint": "tcp://*:1", "topic": "t"})
    assert config == KvEventsConfig(endpoint="tcp://*:1", topic="t")
    with pytest.raises(ValueError, match="unknown KV event publisher"):
        KvEventsConfig.from_vllm({"enable_kv_cache_events": True, "publisher": "kafka"})


async def test_the_rendered_flag_in_the_drop_in_form(context: zmq.asyncio.Context) -> None:
    port, replay = free_port(), free_port()
    rendered = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
                           "replay_endpoint": f"tcp://*:{replay}", "topic": "kv@pod-uid"})  # fmt: skip
    args = ["sim", "serve", "org/Model", "--host", "127.0.0.1", "--port", "0", "--kv-events-config", rendered]
    async with pdserve(*args, env={"PDSERVE_SIM_FAST": "1", "PDSERVE_BIND_HOST": "127.0.0.1"}) as (ready, _):
        url = f"http://127.0.0.1:{ready['http_port']}"
        await wait_healthy(url)
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{port}")
        # PUB drops what it sends before the subscription reaches it: send prompts until one batch arrives.
        async with asyncio.timeout(20):
            for attempt in range(100):
                await _complete(url, " ".join(f"a{attempt}w{i}" for i in range(40)), model="org/Model")
                if await sub.poll(200):
                    break
            topic, _, payload = await sub.recv_multipart()
        assert topic == b"kv@pod-uid" and decode_batch(payload).events


async def test_a_bad_flag_is_a_clear_error() -> None:
    proc = await asyncio.create_subprocess_exec(
        str(__import__("sys").executable), "-m", "pdserve.cli", "sim", "serve", "m", "--port", "0",
        "--kv-events-config", "{not json", stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await proc.communicate()
    assert proc.returncode == 2 and b"--kv-events-config is not JSON" in err
