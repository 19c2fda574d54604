"""The router with a KV store, over real sockets: simulators whose store is a real Mooncake master and store
server on loopback. A decode failure after prefill is served from the store, never by a second prefill."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from pdserve.api.router_config import RouterConfig
from pdserve_dev.testing.metrics import metric_value, scrape, wait_for_metric
from pdserve_dev.testing.mooncake import MooncakeStore, mooncake_store, store_transfer_config
from pdserve_dev.testing.sim import requests_seen, set_faults, sim_process
from pdserve_sim.tokenizer import tokenize

LONG = "Every turn of this conversation starts with the same long system prompt, word after word. " * 12

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeStore]:
    with mooncake_store(tmp_path_factory.mktemp("mooncake")) as running:
        yield running


def engine(role: str, config: Path, engine_id: str, **options: Any) -> Any:
    # Each engine pair keys its blocks apart (cache_prefix), so one case's writes are not the next one's.
    transfer = store_transfer_config(role, engine_id, cache_prefix=f"pdserve/test/{engine_id[2:]}")
    return sim_process(
        "serve", "sim-model", "--block-size", "16", "--kv-transfer-config", transfer,
        fast=True, env={"MOONCAKE_CONFIG_PATH": str(config)}, **options,
    )  # fmt: skip


@pytest.mark.parametrize("kv_store", [True, False])
async def test_a_failed_pull_is_served_from_the_store_without_a_new_prefill(
    store: MooncakeStore,
    tmp_path: Path,
    router_server: Any,
    make_config: Callable[..., RouterConfig],
    kv_store: bool,
) -> None:
    config = store.write_client_config(tmp_path / "mooncake.json")
    async with (
        engine("prefill", config, f"p-{kv_store}") as prefill,
        engine("decode", config, f"d-{kv_store}", kv_transfer_timeout=0.3) as decode,
    ):
        body = {"model": "sim-model", "prompt": LONG, "max_tokens": 4, "ignore_eos": True}
        # The prompt is computed once and written to the store (behind the answer, as vLLM's connector does: wait
        # for the write's count so what follows does not race it).
        async with aiohttp.ClientSession() as http:
            warm = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
            async with http.post(prefill.url + "/v1/completions", json=warm) as resp:
                assert resp.status == 200, await resp.text()
        blocks = len(tokenize(LONG)) // 16
        await wait_for_metric(prefill.url, "pdserve:sim_kv_store_blocks_total", blocks, op="put")
        # Then prefill's side channel closes every pull unanswered: decode's pull fails as it does when the prefill
        # engine is gone. The prompt's blocks are in the store all the same.
        await set_faults(prefill.url, drop_side_channel=True)
        routed = make_config([prefill.url], [decode.url], kv_store=kv_store, disaggregation_threshold_tokens=64)
        async with router_server(routed) as (url, router), aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/completions", json=body) as resp:
                status, text = resp.status, await resp.text()
                assert resp.headers["X-Pdserve-Route"] == "pd"
            # The request is counted once it ended (in `finally`): wait for that count, then read the retries.
            router_metrics = await wait_for_metric(router.metrics_url, "pdserve_router_requests_total", 1)
        retries = "pdserve_router_retries_total"
        by_source = "vllm:prompt_tokens_by_source_total"
        loaded = metric_value(await scrape(decode.url), by_source, source="external_kv_transfer")
        if kv_store:
            assert status == 200, text
            assert await requests_seen(prefill.url) == 2  # the warm-up and the routed one: no second prefill
            assert metric_value(router_metrics, retries, stage="store") == 1
            assert metric_value(router_metrics, retries, stage="reprefill") == 0
            # The prompt came from the store: every full block but the one holding the last prompt token.
            assert loaded == (len(tokenize(LONG)) - 1) // 16 * 16
        else:
            # Without the store the router prefills again, on the only prefill engine, whose KV cannot reach decode
            # either: the request is lost to the client (502) after two prefills.
            assert status == 502, text
            assert await requests_seen(prefill.url) == 3  # the warm-up, the routed one and its second prefill
            assert metric_value(router_metrics, retries, stage="reprefill") == 1
            assert loaded == 0
