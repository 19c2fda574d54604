"""Issue 21, point 1, against a running engine: a real vLLM engine's KV-event publisher, configured by the renderer's
`--kv-events-config`, feeds the router's own subscription and index exactly as the simulator's does.

One real engine (the tier's tiny Llama, block size 128, 64 KV blocks so that a few prompts evict) and one simulator
run the same `vllm serve` flags (the simulator in drop-in mode). The router's `Subscription` follows each into an
`EngineIndex`; prompts are token ids (no tokenizer in the way: the router uses token-id prompts as they are). The
checks, on both engines:

- every batch the real engine publishes decodes (`pdserve.api.kvevents`), none is malformed, and the block-stored
  events carry the prompt's token ids, block by block, as the simulator's do (block size, medium, no adapter);
- the index built from the events is the engine's cache: before each request, the blocks the index says the engine
  holds of the prompt, times the block size, equal the `cached_tokens` the engine then reports for it, through a
  shared prefix, a repeat, and evictions (vLLM's own `BlockRemoved` events must reach the index for that to hold);
- the replay socket answers in the framing the router reads (`Subscription` replays on connect; until this test ran
  against vLLM 0.32, the router read only the reply without the topic frame and got no replay from a real engine).

The hash functions differ (vLLM's sha256 bytes, the simulator's 64-bit integers): the router names blocks by their
token ids and parent, never by the engine's hash (docs/kv-events.md), so that is not compared.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio

from pdserve.api.kvevents import BlockStored, EventBatch, decode_batch, parse_replay, seq_bytes
from pdserve.api.v1alpha1 import PDService
from pdserve.api.validation import validate
from pdserve_dev.realvllm import models
from pdserve_dev.realvllm.engine import local_engine
from pdserve_dev.testing.net import free_ports
from pdserve_dev.testing.sim import sim_process
from pdserve_dev.testing.wait import wait_for_async
from pdserve_operator.render.engine import kv_events_config
from pdserve_runtime.router.endpoints import KvEventSource
from pdserve_runtime.router.kvindex import EngineIndex, match_engines
from pdserve_runtime.router.kvsubscriber import Subscription
from pdserve_runtime.router.prompt_blocks import PromptBlocks
from pdserve_runtime.router.tokens import prompt_key

pytestmark = [pytest.mark.realvllm, pytest.mark.slow, pytest.mark.timeout(600)]

BLOCK = 128
BLOCKS = 64  # the KV cache of both engines: 8192 tokens, so four 2,900-token prompts evict
VOCAB = range(10, 700)  # inside both the tiny model's vocabulary (800) and the simulator's
#: The topic the kubelet makes of the renderer's `kv@$(POD_NAME)-$(POD_UID)`.
TOPIC = "kv@engine-0-uid"


def _flags(port: int, replay_port: int) -> list[str]:
    """The serve flags both engines get: the renderer's --kv-events-config (its ports moved to free ones)."""
    pds = PDService.model_validate(
        {
            "metadata": {"name": "events", "namespace": "ns", "uid": "u"},
            "spec": {
                "model": {"name": models.MODEL_NAME, "uri": f"hf://{models.REPO_ID}"},
                "engine": {"image": "vllm/vllm-openai:v0.32.0", "kvEvents": {"port": port, "replayPort": replay_port}},
            },
        }
    )
    _, spec = validate(pds).require()
    config = kv_events_config(spec)
    assert config["topic"] == "kv@$(POD_NAME)-$(POD_UID)", "the renderer's topic changed: update TOPIC"
    config["topic"] = TOPIC
    return [
        "--kv-events-config", json.dumps(config), "--num-gpu-blocks-override", str(BLOCKS),
        "--enable-prompt-tokens-details", "--max-num-seqs", "4", "--max-model-len", "4096",
    ]  # fmt: skip


@dataclass
class Engine:
    name: str
    url: str
    events: KvEventSource


@pytest.fixture(scope="module")
def real_engine(real_vllm: object) -> Iterator[Engine]:
    http, events, replay = free_ports(3)
    with local_engine(port=http, core=1, extra=tuple(_flags(events, replay))) as url:
        yield Engine("real", url, KvEventSource(f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}"))


@pytest.fixture
async def sim_engine() -> AsyncIterator[Engine]:
    events, replay = free_ports(2)
    serve = ("serve", models.REPO_ID, "--served-model-name", models.MODEL_NAME, "--block-size", str(BLOCK))
    async with sim_process(*serve, *_flags(events, replay), fast=True) as sim:
        yield Engine("sim", sim.url, KvEventSource(f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}"))


class Follower:
    """The router's view of one engine: its subscription and index, and the requests that check them."""

    def __init__(self, engine: Engine, context: zmq.asyncio.Context, session: aiohttp.ClientSession) -> None:
        self.engine = engine
        self.index = EngineIndex()
        self.subscription = Subscription(engine.events, self.index, context, label=engine.name)
        self.session = session
        self.markers = 0

    def held(self, prompt: list[int]) -> int:
        """Tokens of `prompt` the index says the engine holds (its leading full blocks)."""
        chain = PromptBlocks(prompt_key({"prompt": prompt}, chat=False), BLOCK)  # the router's key of the request
        match = match_engines({"e": [self.index]}, chain).get("e")
        return 0 if match is None else match.blocks * BLOCK

    async def complete(self, prompt: list[int]) -> int:
        """Serve `prompt` (one token out); the engine's own count of prompt tokens it found cached."""
        body = {"model": models.MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        async with self.session.post(f"{self.engine.url}/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()
            usage = (await response.json())["usage"]
        details = usage.get("prompt_tokens_details") or {}
        cached: int = details.get("cached_tokens") or 0
        return cached

    async def synced(self) -> None:
        """Every batch the engine published for earlier requests is in the index: a fresh one-block marker prompt
        is served, and its block arrives after theirs (one publisher, batches in order)."""
        self.markers += 1
        marker = _prompt(BLOCK + 5, seed=10_000 + self.markers)
        await self.complete(marker)

        async def arrived() -> bool | None:
            return self.held(marker) == BLOCK or None

        await wait_for_async(arrived, within=30, message=f"{self.engine.name}: the marker's block in the index")

    async def check(self, prompt: list[int]) -> int:
        """The index's claim about `prompt`, then the engine's answer: they must agree."""
        await self.synced()
        claimed = self.held(prompt)
        cached = await self.complete(prompt)
        assert cached == claimed, f"{self.engine.name}: index says {claimed} tokens cached, the engine {cached}"
        return cached


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice(VOCAB) for _ in range(length)]


async def _replayed(context: zmq.asyncio.Context, source: KvEventSource) -> list[tuple[int, EventBatch]]:
    """Every batch the publisher still buffers, asked for from 0 as the router's replay asks."""
    assert source.replay_endpoint is not None
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(source.replay_endpoint)
    out: list[tuple[int, EventBatch]] = []
    try:
        await dealer.send_multipart((b"", seq_bytes(0)))
        async with asyncio.timeout(10):
            while True:
                message = parse_replay(await dealer.recv_multipart())
                if message.seq < 0:
                    break
                assert message.topic == TOPIC.encode(), message.topic  # vLLM 0.32's reply carries the topic
                out.append((message.seq, decode_batch(message.payload)))
    finally:
        dealer.close()
    return out


def _stored_of(prompt: list[int], batches: list[tuple[int, EventBatch]]) -> list[BlockStored]:
    """The block-stored events of `prompt`'s blocks (a block-aligned run of its tokens), in prompt order."""
    found: list[tuple[int, BlockStored]] = []
    for _, batch in batches:
        for event in batch.events:
            if not isinstance(event, BlockStored):
                continue
            ids = list(event.token_ids)
            for start in range(0, len(prompt) - len(ids) + 1, BLOCK):
                if prompt[start : start + len(ids)] == ids:
                    found.append((start, event))
                    break
    return [event for _, event in sorted(found, key=lambda item: item[0])]


async def _scenario(engine: Engine) -> tuple[list[int], list[BlockStored], Follower]:
    """The same requests on one engine; returns the engine-reported cached tokens per check, the block-stored
    events of the first prompt, and the follower (for its subscription's counts)."""
    context = zmq.asyncio.Context()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            follower = Follower(engine, context, session)
            follower.subscription.start()
            try:
                first = _prompt(3 * BLOCK + 50, seed=1)
                cached = [await follower.check(first)]  # nothing held yet
                stored = _stored_of(first, await _replayed(context, engine.events))
                cached.append(await follower.check(first))  # held whole: its three full blocks
                shared = first[: 2 * BLOCK] + _prompt(BLOCK + 70, seed=2)
                cached.append(await follower.check(shared))  # two blocks shared
                for seed in range(3, 7):  # four long prompts: 88 blocks into 64 evict the oldest
                    cached.append(await follower.check(_prompt(22 * BLOCK + 30, seed=seed)))
                cached.append(await follower.check(first))  # evicted (whatever the engine kept, the index says)
                cached.append(await follower.check(_prompt(22 * BLOCK + 30, seed=6)))  # the last long one
                stats = follower.subscription.stats
                # The router's own replay (on connect) was answered and read: no malformed message, no timeout.
                assert stats.malformed == 0 and stats.replay_failures == 0 and stats.replays >= 1, stats
                assert stats.batches > 0
                return cached, stored, follower
            finally:
                await follower.subscription.stop()
    finally:
        context.destroy(linger=0)


async def test_a_real_engines_events_index_its_cache_as_the_simulators_do(
    real_engine: Engine, sim_engine: Engine
) -> None:
    real_cached, real_stored, real = await _scenario(real_engine)
    sim_cached, sim_stored, _ = await _scenario(sim_engine)

    # Each engine's index agreed with the engine at every step (Follower.check); the engines agree with each other.
    assert real_cached == sim_cached, f"real {real_cached} vs simulator {sim_cached}"
    assert real_cached[:3] == [0, 3 * BLOCK, 2 * BLOCK]
    assert real_cached[-2] < 3 * BLOCK, "the first prompt was evicted by the long ones (BlockRemoved reached the index)"
    assert real_cached[-1] == 22 * BLOCK, "the last long prompt is still held after the evictions"
    assert real.index.applied > 0 and len(real.index) <= BLOCKS

    # The first prompt's blocks as each engine announced them: same token ids block by block, same block size,
    # medium and adapter fields; the chain starts at the root.
    def shape(events: list[BlockStored]) -> list[tuple[Any, ...]]:
        return [(e.block_size, e.medium, e.lora_id, e.lora_name, e.has_extra_keys) for e in events]

    def tokens(events: list[BlockStored]) -> list[int]:
        return [t for e in events for t in e.token_ids]

    assert real_stored and sim_stored
    assert tokens(real_stored) == tokens(sim_stored) == _prompt(3 * BLOCK + 50, seed=1)[: 3 * BLOCK]
    assert shape(real_stored) == shape(sim_stored) and shape(real_stored)[0][0] == BLOCK, (real_stored, sim_stored)
    assert real_stored[0].parent_block_hash is None and sim_stored[0].parent_block_hash is None
