"""Engine-reported KV-cache usage: parsing the exposition, the headroom scorer, scraping a real simulator."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pdserve_dev.testing.sim import sim_in_process
from pdserve_runtime.router.endpoints import Endpoint, EndpointState, EndpointTable
from pdserve_runtime.router.engine_metrics import EngineMetricsScraper, parse_kv_usage
from pdserve_runtime.router.policy.base import PickContext
from pdserve_runtime.router.policy.scorer_kv_usage import KvCacheHeadroomScorer
from pdserve_runtime.router.tokens import PromptInfo
from pdserve_runtime.transport.client import EngineClient

StateFactory = Callable[..., EndpointState]


@pytest.mark.parametrize(
    ("text", "usage"),
    [
        (b"", None),
        (b'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n', 0.25),
        (b"vllm:kv_cache_usage_perc 0.5\n", 0.5),
        (b'vllm:kv_cache_usage_perc{engine="0"} 0.1\nvllm:kv_cache_usage_perc{engine="1"} 0.7\n', 0.7),
        (b"# HELP vllm:kv_cache_usage_perc KV usage\n# TYPE vllm:kv_cache_usage_perc gauge\n", None),
        (b"vllm:kv_cache_usage_perc_other 0.9\nvllm:kv_cache_usage_perc NaN\n", None),
        (b"vllm:kv_cache_usage_perc 1.7\n", 1.0),  # clamped
    ],
)
def test_parse_kv_usage(text: bytes, usage: float | None) -> None:
    assert parse_kv_usage(text) == usage


@pytest.mark.parametrize(
    ("readings", "expected"),
    [
        ([None, None], [1.0, 1.0]),  # nothing known: no preference
        ([(0.2, 100.0), (0.8, 100.0)], [0.8, 0.2]),
        ([(0.2, 100.0), None], [0.8, 0.8]),  # unknown gets the mean of the known
        ([(0.2, 100.0), (0.6, 10.0)], [0.8, 0.8]),  # stale reading counts as unknown
    ],
)
def test_kv_headroom_scorer(
    make_state: StateFactory, readings: list[tuple[float, float] | None], expected: list[float]
) -> None:
    states = []
    for index, reading in enumerate(readings):
        state = make_state(f"d{index}")
        if reading is not None:
            state.kv_cache_usage, state.kv_cache_usage_at = reading
        states.append(state)
    scorer = KvCacheHeadroomScorer(stale_after=30.0, clock=lambda: 101.0)
    ctx = PickContext(prompt=PromptInfo(key=b"tx", block_size=16))
    assert scorer.score(ctx, states) == pytest.approx(expected)


async def test_scraper_reads_a_simulator() -> None:
    client = EngineClient(connect_timeout=1.0)
    async with sim_in_process(role="decode") as d:
        table = EndpointTable()
        table.replace("decode", [Endpoint(url=d.url, role="decode"), Endpoint(url="http://127.0.0.1:9", role="decode")])
        scraper = EngineMetricsScraper(table, interval=10.0)
        live, dead = table.states("decode")
        await scraper.scrape(client, live)
        await scraper.scrape(client, dead)
        await client.close()
        assert live.kv_cache_usage is not None and 0.0 <= live.kv_cache_usage <= 1.0
        assert dead.kv_cache_usage is None
        assert dead.breaker.allows_traffic()  # a metrics failure is not a serving failure
