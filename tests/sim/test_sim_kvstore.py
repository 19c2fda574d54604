"""The simulator's KV store path against a real Mooncake master and store server on loopback.

The engines are started in drop-in mode with the kv-transfer-config and the MOONCAKE_CONFIG_PATH file pdserve's
renderer writes (MultiConnector: NIXL first, then MooncakeStoreConnector), so what is checked is what a PDService
with `engine.kvCache.store` runs.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from pdserve_dev.testing.metrics import metric_value, scrape, wait_for_metric
from pdserve_dev.testing.mooncake import MooncakeStore, master_metric, mooncake_store, store_transfer_config
from pdserve_dev.testing.sim import sim_process
from pdserve_sim.tokenizer import tokenize

BLOCK = 16
PROMPT = "A long system prompt that every turn of the conversation starts with, word after word. " * 12
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}
PREFIX = "pdserve/test/svc/abc"

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeStore]:
    with mooncake_store(tmp_path_factory.mktemp("mooncake")) as running:
        yield running


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


def engine(role: str, config: Path, engine_id: str) -> Any:
    transfer = store_transfer_config(role, engine_id, PREFIX)
    return sim_process(
        "serve", "tiny", "--block-size", str(BLOCK), "--kv-transfer-config", transfer,
        fast=True, env={"MOONCAKE_CONFIG_PATH": str(config)},
    )  # fmt: skip


async def complete(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with http.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        data: dict[str, Any] = await resp.json()
        return data


async def test_decode_loads_the_prompt_from_the_store_after_prefill_is_gone(
    store: MooncakeStore, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    config = store.write_client_config(tmp_path / "mooncake.json")
    prompt_tokens = len(tokenize(PROMPT))
    full_blocks = prompt_tokens // BLOCK
    keys_before = master_metric(store, "master_key_count")
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True}
    async with engine("prefill", config, "prefill-0") as prefill:
        answer = await complete(http, prefill.url, {**body, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS})
        assert answer["kv_transfer_params"]["do_remote_prefill"] is True
        # The write goes on behind the answer (as vLLM's store connector queues it): wait for its count.
        await wait_for_metric(prefill.url, "pdserve:sim_kv_store_blocks_total", full_blocks, op="put")
        assert master_metric(store, "master_key_count") - keys_before == full_blocks
    # Prefill is gone (its process stopped): decode gets the prompt as the router's store retry sends it, without
    # kv_transfer_params, and loads every full block but the one holding the last prompt token.
    async with engine("decode", config, "decode-0") as decode:
        result = await complete(http, decode.url, body)
        assert result["usage"]["completion_tokens"] == 8
        metrics = await scrape(decode.url)
        loaded = (prompt_tokens - 1) // BLOCK * BLOCK
        by_source = "vllm:prompt_tokens_by_source_total"
        assert metric_value(metrics, by_source, source="external_kv_transfer") == loaded
        assert metric_value(metrics, by_source, source="local_compute") == prompt_tokens - loaded
        assert metric_value(metrics, "pdserve:sim_kv_store_blocks_total", op="get") == loaded // BLOCK
        # A decode engine only reads: nothing more was written.
        assert metric_value(metrics, "pdserve:sim_kv_store_blocks_total", op="put") == 0


async def test_a_prompt_the_store_does_not_hold_is_computed(
    store: MooncakeStore, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    config = store.write_client_config(tmp_path / "mooncake.json")
    async with engine("decode", config, "decode-1") as decode:
        prompt = "Nobody computed this prompt before; the store has none of its blocks. " * 8
        await complete(http, decode.url, {"model": "tiny", "prompt": prompt, "max_tokens": 2})
        metrics = await scrape(decode.url)
        by_source = "vllm:prompt_tokens_by_source_total"
        assert metric_value(metrics, by_source, source="external_kv_transfer") == 0
        assert metric_value(metrics, by_source, source="local_compute") == len(tokenize(prompt))


async def test_an_engine_without_its_store_does_not_start(tmp_path: Path) -> None:
    config = tmp_path / "mooncake.json"
    config.write_text(
        json.dumps({"master_server_address": "127.0.0.1:1", "metadata_server": "http://127.0.0.1:1/metadata"})
    )
    with pytest.raises(RuntimeError):
        async with engine("decode", config, "decode-2"):
            pass
