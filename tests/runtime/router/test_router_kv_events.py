"""Routers following the engines' KV events: what one router replica sent where, another one knows; a restarted
router knows it again from the engines' replay; without events a router keeps its own tracking."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp

from pdserve.api.router_config import KvEventsEndpoints, RouterConfig
from pdserve_dev.testing.net import free_port
from pdserve_dev.testing.sim import sim_server_in_process
from pdserve_runtime.router.app import RouterApp
from pdserve_sim.kvevents import KvEventsConfig
from tests.runtime.router.conftest import running_router

SYSTEM = " ".join(f"rule{i} says the answer must be careful and short" for i in range(120))  # ~1,000 tokens


def _events() -> KvEventsConfig:
    return KvEventsConfig(
        endpoint=f"tcp://127.0.0.1:{free_port()}", replay_endpoint=f"tcp://127.0.0.1:{free_port()}", topic="kv@t"
    )


@asynccontextmanager
async def engines(*, publish: bool = True) -> AsyncIterator[tuple[Any, list[Any]]]:
    """One prefill and two decode simulators on loopback, publishing KV events when `publish`."""
    async with AsyncExitStack() as stack:
        prefill = await stack.enter_async_context(
            sim_server_in_process(role="prefill", kv_events=_events() if publish else None)
        )
        decodes = [
            await stack.enter_async_context(
                sim_server_in_process(role="decode", kv_events=_events() if publish else None)
            )
            for _ in range(2)
        ]
        yield prefill, decodes


def _url(server: Any) -> str:
    return f"http://127.0.0.1:{server.http_port}"


def _config(make_config: Callable[..., RouterConfig], prefill: Any, decodes: list[Any], **policy: Any) -> RouterConfig:
    kv_events = {
        _url(server): [KvEventsEndpoints(endpoint=cfg.endpoint, replay_endpoint=cfg.replay_endpoint)]
        for server in [prefill, *decodes]
        if (cfg := server.config.kv_events) is not None
    }
    return make_config(
        [_url(prefill)],
        [_url(server) for server in decodes],
        disaggregation_threshold_tokens=256,
        static_kv_events=kv_events,
        **policy,
    )


async def _chat(session: aiohttp.ClientSession, router: str, turns: list[dict[str, str]]) -> tuple[str, str]:
    body = {"model": "sim-model", "messages": turns, "max_tokens": 8}
    async with session.post(router + "/v1/chat/completions", json=body) as response:
        answer = await response.json()
        assert response.status == 200, answer
        return response.headers["X-Pdserve-Route"], answer["choices"][0]["message"]["content"]


async def _until_indexed(router: RouterApp, url: str, blocks: int) -> None:
    """Wait (bounded) until the router's index of `url` holds at least `blocks` blocks: a counted event."""
    async with asyncio.timeout(10):
        while sum(len(index) for index in router.kv_events.indices().get(url, [])) < blocks:
            subs = router.kv_events.subscriptions(url)
            assert subs, f"no subscription to {url}"
            subs[0].applied.clear()
            await subs[0].applied.wait()


async def test_a_turn_another_replica_routed_stays_off_prefill(make_config: Callable[..., RouterConfig]) -> None:
    async with engines() as (prefill, decodes):
        config = _config(make_config, prefill, decodes)
        async with (
            running_router(config) as (first_url, first),
            running_router(config) as (second_url, second),
            aiohttp.ClientSession() as session,
        ):
            turns = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question here"}]
            route, answer = await _chat(session, first_url, turns)
            assert route == "pd"  # ~1,000 uncached tokens
            holder = next(d for d in decodes if d.engine.pool.num_cached)
            await _until_indexed(second, _url(holder), blocks=10)
            turns += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and a second one"}]
            route, _ = await _chat(session, second_url, turns)
            # The second router never saw turn 1, but the decode engine's events say it holds the prefix.
            assert route == "decode-only"
            assert second.kv_events.confirmed(_url(holder))
            assert not first.kv_events.confirmed(_url(holder))  # it routed turn 1 but never matched a prompt since


async def test_without_events_another_replica_sends_the_turn_through_prefill(
    make_config: Callable[..., RouterConfig],
) -> None:
    async with engines(publish=False) as (prefill, decodes):
        config = _config(make_config, prefill, decodes)
        async with (
            running_router(config) as (first_url, _),
            running_router(config) as (second_url, _),
            aiohttp.ClientSession() as session,
        ):
            turns = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question here"}]
            route, answer = await _chat(session, first_url, turns)
            assert route == "pd"
            turns += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and a second one"}]
            route, _ = await _chat(session, second_url, turns)
            assert route == "pd"  # today's behaviour: the second replica's tracker never saw turn 1


async def test_a_restarted_router_learns_the_caches_from_the_replay(make_config: Callable[..., RouterConfig]) -> None:
    async with engines() as (prefill, decodes), aiohttp.ClientSession() as session:
        config = _config(make_config, prefill, decodes)
        turns = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question here"}]
        async with running_router(config) as (url, _):
            route, answer = await _chat(session, url, turns)
            assert route == "pd"
        holder = next(d for d in decodes if d.engine.pool.num_cached)
        # A new router process: nothing in its tracker; the engines' replay buffers hold every batch.
        async with running_router(config) as (url, router):
            await _until_indexed(router, _url(holder), blocks=10)
            assert router.kv_events.subscriptions(_url(holder))[0].stats.replayed_batches >= 1
            turns += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and a second one"}]
            route, _ = await _chat(session, url, turns)
            assert route == "decode-only"


def test_slice_ports_name_each_ranks_publisher() -> None:
    from pdserve.api.router_config import KvEventsPortNames
    from pdserve_runtime.router.discovery.kubernetes import endpoints_from_slice
    from pdserve_runtime.router.endpoints import KvEventSource

    slice_obj = {
        "addressType": "IPv4",
        "ports": [
            {"name": "http", "port": 8000},
            {"name": "kv-events-0", "port": 5557},
            {"name": "kv-replay-0", "port": 5657},
            {"name": "kv-events-1", "port": 5558},
        ],
        "endpoints": [{"addresses": ["10.0.0.5"], "conditions": {"ready": True}}],
    }
    names = [KvEventsPortNames(events=f"kv-events-{r}", replay=f"kv-replay-{r}") for r in range(3)]
    [endpoint] = endpoints_from_slice(
        slice_obj, role="decode", port_name="http", kv_compat_label="x", topology_labels=(), nodes={},
        kv_events_ports=names,
    )  # fmt: skip
    # Rank 1 has no replay port in the slice (followed live only); rank 2 has no publisher port (not followed).
    assert endpoint.kv_events == (
        KvEventSource("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5657"),
        KvEventSource("tcp://10.0.0.5:5558", None),
    )
    [without] = endpoints_from_slice(
        slice_obj, role="decode", port_name="http", kv_compat_label="x", topology_labels=(), nodes={}
    )
    assert without.kv_events == ()


def test_static_flags() -> None:
    import click
    import pytest

    from pdserve.api.settings import RouterSettings
    from pdserve_runtime.router.cli import load_config

    def flags(*kv_events: str) -> RouterSettings:
        return RouterSettings(decode=("http://d:8000",), kv_events=kv_events)

    config = load_config(flags("http://d:8000/=tcp://d:5557,tcp://d:5657", "http://d:8000=tcp://d:5558"))
    assert [(s.endpoint, s.replay_endpoint) for s in config.static_kv_events["http://d:8000"]] == [
        ("tcp://d:5557", "tcp://d:5657"),
        ("tcp://d:5558", None),
    ]
    with pytest.raises(click.BadParameter, match="URL=tcp://HOST:PORT"):
        load_config(flags("tcp://d:5557"))
    with pytest.raises(click.ClickException, match="invalid router config"):
        load_config(flags("http://d:8000=http://d:5557"))
