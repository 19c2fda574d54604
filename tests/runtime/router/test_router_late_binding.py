"""Late binding through real sockets: requests wait in the router until an engine has room (issue 19 item 1).

The engines are `GatedEngine`s: each holds every request until the test lets it go, and counts what it holds at
every moment, so each test waits for a counted state (what an engine holds, what the router's queue holds) and
then asserts.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Literal

import aiohttp
import pytest

from pdserve.api.router_config import AdmissionConfig, RouterConfig
from pdserve_dev.testing.gated_engine import GatedEngine
from pdserve_dev.testing.metrics import metric_value, scrape
from pdserve_dev.testing.wait import wait_for_async

pytestmark = pytest.mark.timeout(180)

Answer = tuple[int, dict[str, str], Any]


@pytest.fixture
def make_config(make_config: Callable[..., RouterConfig]) -> Callable[..., RouterConfig]:
    """The package's config (whose connect timeout never binds on loopback) with a first-byte timeout that never
    binds here either. These tests hold requests at gated engines while a burst of up to 500 reaches the router's
    queue, which takes tens of seconds on a loaded machine: the default 30 s first-byte timeout then fires on the
    held requests and turns the queue under test into failovers (a fresh-clone run waited for 499 queued requests
    and found 0)."""

    def make(prefill: list[str], decode: list[str], **policy: Any) -> RouterConfig:
        policy.setdefault("first_byte_timeout_seconds", 300.0)
        return make_config(prefill, decode, **policy)

    return make


@asynccontextmanager
async def gated(*roles: Literal["prefill", "decode"], hold: bool = True) -> AsyncIterator[list[GatedEngine]]:
    """Gated engines of these roles (decode ones answer at once unless `hold`), always stopped."""
    engines = [GatedEngine(role, hold=hold or role == "prefill") for role in roles]
    try:
        for engine in engines:
            await engine.start()
        yield engines
    finally:
        for engine in engines:
            await engine.stop()


_UNIQUE = itertools.count(1000)


def ids(tag: int, tokens: int) -> list[int]:
    """A token-id prompt of `tokens` tokens whose first id names its client; unique, so nothing is cached."""
    return [tag, next(_UNIQUE), *range(2000, 2000 + tokens - 2)]


async def post(session: aiohttp.ClientSession, url: str, prompt: list[int], key: str | None = None) -> Answer:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 1}
    async with session.post(url + "/v1/completions", json=body, headers=headers) as response:
        data = await response.json(content_type=None)
        return response.status, dict(response.headers), data


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=150))


async def until(predicate: Callable[[], bool], message: str | Callable[[], str]) -> None:
    """Wait (60 s at most: a burst of 500 requests reaches the queue slowly on a loaded machine) until
    `predicate()` holds: the state of in-process routers and engines, polled."""

    async def check() -> bool:
        return predicate()

    await wait_for_async(check, within=60, interval=0.01, message=message)


async def waiting(router: Any, pool: str, count: int) -> None:
    await until(lambda: router.gate.queue.waiting(pool) == count,
                lambda: f"{count} waiting for {pool}, have {router.gate.queue.waiting(pool)}")  # fmt: skip


def admission(**changes: Any) -> AdmissionConfig:
    return AdmissionConfig(**changes)


async def test_a_prefill_engine_that_becomes_ready_takes_waiting_requests_and_none_stays_behind_a_slow_one(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    async with gated("prefill", "prefill", "decode", hold=False) as (slow, new, decode), session() as client:
        new.ready = False
        config = make_config(
            [slow.url, new.url],
            [decode.url],
            disaggregation_threshold_tokens=0,
            static_health_interval_seconds=0.05,
            admission=admission(prefill_budget_tokens=4000),
        )
        async with router_server(config) as (url, router):
            await until(lambda: len(router.table.usable("prefill")) == 1, "the new engine not ready")
            # A burst of 12 long prompts: the slow engine takes two (3000 tokens; a third would pass 4000).
            burst = [asyncio.create_task(post(client, url, ids(tag, 1500))) for tag in range(12)]
            await waiting(router, "prefill", 10)
            await slow.wait_until(lambda engine: len(engine.held) == 2)
            assert slow.held_tokens == 3000
            # The new engine becomes ready: it takes two waiting requests as soon as the router sees it.
            new.ready = True
            await new.wait_until(lambda engine: len(engine.held) == 2)
            assert router.gate.queue.waiting("prefill") == 8
            # It serves the rest while the slow engine still holds its two: nothing else went to the slow one.
            new.open()
            await waiting(router, "prefill", 0)
            await until(lambda: sum(task.done() for task in burst) == 10, "10 served")
            assert (len(slow.seen), len(new.seen), len(slow.held)) == (2, 10, 2)
            slow.open()
            answers = await asyncio.gather(*burst)
        assert [status for status, _, _ in answers] == [200] * 12
        assert slow.peak_tokens <= 4000 and new.peak_tokens <= 4000


async def test_two_router_replicas_never_put_more_than_the_budget_on_one_engine(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    budget = 4000
    async with gated("prefill", "decode", hold=False) as (prefill, decode), session() as client:
        config = make_config(
            [prefill.url],
            [decode.url],
            disaggregation_threshold_tokens=0,
            admission=admission(prefill_budget_tokens=budget, router_replicas=2),
        )
        async with router_server(config) as (url_a, router_a), router_server(config) as (url_b, router_b):
            sizes = [300, 1900, 700, 1200, 1000, 500, 1800, 900, 1500, 400] * 4
            tasks = [
                asyncio.create_task(post(client, (url_a, url_b)[index % 2], ids(index % 5, size)))
                for index, size in enumerate(sizes)
            ]
            done = 0
            # Release the engine's requests one at a time; before each release, wait until every request is either
            # held by the engine, waiting in a router, or answered (a settled state), then check the engine.
            while done < len(sizes):

                def settled(done: int = done) -> bool:
                    queued = router_a.gate.queue.waiting("prefill") + router_b.gate.queue.waiting("prefill")
                    return len(prefill.held) + queued + done == len(sizes) and bool(prefill.held)

                await until(settled, f"settled after {done} answers")
                assert prefill.held_tokens <= budget
                prefill.release(1)
                done += 1

                def answered(done: int = done) -> bool:
                    return sum(task.done() for task in tasks) >= done

                await until(answered, "an answer")
            answers = await asyncio.gather(*tasks)
        assert [status for status, _, _ in answers] == [200] * len(sizes)
        assert prefill.peak_tokens <= budget
        assert len(prefill.seen) == len(sizes)


async def test_one_clients_burst_does_not_go_before_another_clients_request(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    async with gated("prefill", "decode", hold=False) as (prefill, decode), session() as client:
        config = make_config(
            [prefill.url],
            [decode.url],
            disaggregation_threshold_tokens=0,
            admission=admission(prefill_budget_tokens=2000),
        )
        async with router_server(config) as (url, router):
            burst = [asyncio.create_task(post(client, url, ids(1, 1000), key="client-a")) for _ in range(500)]
            await waiting(router, "prefill", 498)
            other = asyncio.create_task(post(client, url, ids(2, 1000), key="client-b"))
            await waiting(router, "prefill", 499)
            prefill.release(1)
            await prefill.wait_until(lambda engine: len(engine.seen) == 3)
            # Client B's one request is the next to reach the engine, ahead of 497 of client A's.
            assert [held.tag for held in prefill.seen] == [1, 1, 2]
            prefill.open()
            answers = await asyncio.gather(*burst, other)
        assert [status for status, _, _ in answers] == [200] * 501


async def test_a_request_that_waits_past_its_useful_deadline_is_told_why_with_retry_after(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    async with gated("prefill", "decode", hold=False) as (prefill, decode), session() as client:
        config = make_config(
            [prefill.url],
            [decode.url],
            disaggregation_threshold_tokens=0,
            retry_after_seconds=3,
            admission=admission(prefill_budget_tokens=1000, max_queue_seconds=0.3),
        )
        async with router_server(config) as (url, router):
            tasks = [asyncio.create_task(post(client, url, ids(index, 1000))) for index in range(5)]
            # One is held by the engine; the four others wait 0.3 s and are shed (the engine never frees up).
            await until(lambda: sum(task.done() for task in tasks) == 4, "4 shed")
            assert len(prefill.held) == 1
            prefill.open()
            answers = await asyncio.gather(*tasks)
            exposition = await scrape(router.metrics_url)
        statuses = sorted(status for status, _, _ in answers)
        assert statuses == [200, 503, 503, 503, 503], answers
        for status, headers, body in answers:
            if status == 503:
                assert int(headers["Retry-After"]) >= 3
                error = body["error"]
                assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
                assert "no prefill engine had room for this request within" in error["message"]
                assert "could no longer meet a useful deadline" in error["message"]
        assert metric_value(exposition, "pdserve_router_shed_total", pool="prefill", reason="deadline") == 4
        assert metric_value(exposition, "pdserve_router_requests_total", outcome="shed") == 4
        assert metric_value(exposition, "pdserve_router_requests_total", outcome="success") == 1
        assert metric_value(exposition, "pdserve_router_queue_requests", pool="prefill") == 0
        assert len(prefill.seen) == 1  # nothing shed ever reached an engine


async def test_a_full_queue_refuses_the_client_over_its_share_and_makes_room_for_another(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    async with gated("prefill", "decode", hold=False) as (prefill, decode), session() as client:
        config = make_config(
            [prefill.url],
            [decode.url],
            disaggregation_threshold_tokens=0,
            admission=admission(prefill_budget_tokens=1000, max_queued_requests=4),
        )
        async with router_server(config) as (url, router):
            first = [asyncio.create_task(post(client, url, ids(1, 1000), key="a")) for _ in range(5)]
            await waiting(router, "prefill", 4)  # one held by the engine, four waiting: the queue is full
            refused = await post(client, url, ids(1, 1000), key="a")
            later = asyncio.create_task(post(client, url, ids(2, 1000), key="b"))
            pushed_out = await asyncio.wait_for(_first_answer(first), 20)
            prefill.open()
            answers = await asyncio.gather(*first, later)
            exposition = await scrape(router.metrics_url)
        status, headers, body = refused
        assert status == 429 and "Retry-After" in headers
        assert body["error"]["type"] == "RateLimitError"
        assert "the router's queue is full (4 requests waiting for an engine)" in body["error"]["message"]
        assert "this client already has 4 of them, its fair share" in body["error"]["message"]
        status, headers, body = pushed_out
        assert status == 429 and "Retry-After" in headers
        assert "removed from the router's full queue for another client's" in body["error"]["message"]
        assert sorted(status for status, _, _ in answers) == [200] * 5 + [429]
        assert metric_value(exposition, "pdserve_router_shed_total", reason="queue_full") == 1
        assert metric_value(exposition, "pdserve_router_shed_total", reason="client_share") == 1


async def _first_answer(tasks: list[asyncio.Task[Answer]]) -> Answer:
    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    return next(iter(done)).result()


async def test_waiting_requests_are_told_to_retry_when_the_router_stops(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    async with gated("prefill", "decode", hold=False) as (prefill, decode), session() as client:
        config = make_config(
            [prefill.url],
            [decode.url],
            disaggregation_threshold_tokens=0,
            admission=admission(prefill_budget_tokens=1000),
        )
        async with router_server(config) as (url, router):
            tasks = [asyncio.create_task(post(client, url, ids(index, 1000))) for index in range(4)]
            await waiting(router, "prefill", 3)
            stopping = asyncio.create_task(router.stop(grace=10.0))
            await until(lambda: sum(task.done() for task in tasks) == 3, "3 told")
            prefill.open()  # the one in flight finishes within the grace period
            await stopping
            answers = await asyncio.gather(*tasks)
        assert sorted(status for status, _, _ in answers) == [200, 503, 503, 503]
        for status, headers, body in answers:
            if status == 503:
                assert headers["Retry-After"] == str(config.retry_after_seconds)
                assert "the router is shutting down" in body["error"]["message"]


async def test_a_client_that_leaves_while_waiting_is_never_sent_to_an_engine(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    async with gated("prefill", "decode", hold=False) as (prefill, decode), session() as client:
        config = make_config(
            [prefill.url],
            [decode.url],
            disaggregation_threshold_tokens=0,
            admission=admission(prefill_budget_tokens=1000),
        )
        async with router_server(config) as (url, router):
            held = asyncio.create_task(post(client, url, ids(1, 1000)))
            await prefill.wait_until(lambda engine: len(engine.held) == 1)
            leaving = asyncio.create_task(post(client, url, ids(2, 1000)))
            await waiting(router, "prefill", 1)
            leaving.cancel()
            await waiting(router, "prefill", 0)
            prefill.open()
            assert (await held)[0] == 200
            # The engine has room again and nothing waits: the next request goes at once, the one that left never.
            assert (await post(client, url, ids(3, 1000)))[0] == 200
        assert [request.tag for request in prefill.seen] == [1, 3]


async def test_engine_reported_load_from_elsewhere_shrinks_the_room(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    async with gated("decode") as (decode,), session() as client:
        decode.others = 3  # the engine runs three requests this router did not send
        config = make_config(
            [],
            [decode.url],
            engine_metrics_interval_seconds=0.05,
            admission=admission(decode_budget_sequences=4),
        )
        async with router_server(config) as (url, router):
            await decode.wait_until(lambda engine: engine.metrics_reads >= 2)
            tasks = [asyncio.create_task(post(client, url, ids(index, 10))) for index in range(3)]
            await waiting(router, "decode", 2)
            assert len(decode.held) == 1  # 4 - 3 others
            decode.others = 0  # the other load ends: the next read gives the room back
            await decode.wait_until(lambda engine: len(engine.held) == 3)
            decode.open()
            answers = await asyncio.gather(*tasks)
        assert [status for status, _, _ in answers] == [200] * 3
