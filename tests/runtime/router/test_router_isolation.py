"""No client can hurt another (issue 12): each test is one finding of an adversarial run against the router and
the simulator, on real sockets, with the simulator's fault injection or a small scripted engine where an engine
must answer in a way the simulator never does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from pdserve.api.router_config import RouterConfig
from pdserve_dev.testing.metrics import metric_value, scrape, wait_for_metric
from pdserve_dev.testing.sim import sim_in_process
from pdserve_runtime.router.app import RouterApp

pytestmark = pytest.mark.timeout(60)

LONG = "The history of the river valley settlements began with small farms. " * 30  # ~ 360 tokens
SHORT = "Say hi."


async def set_faults(url: str, **faults: Any) -> None:
    async with aiohttp.ClientSession() as session, session.post(url + "/sim/faults", json=faults) as response:
        assert response.status == 200, await response.text()


async def requests_seen(url: str) -> int:
    async with aiohttp.ClientSession() as session, session.get(url + "/sim/faults") as response:
        return int((await response.json())["requests_seen"])


async def post(
    url: str, body: dict[str, Any], headers: dict[str, str] | None = None, path: str = "/v1/completions"
) -> tuple[int, Any, bytes]:
    async with aiohttp.ClientSession() as session, session.post(url + path, json=body, headers=headers) as response:
        return response.status, response.headers.copy(), await response.read()


async def router_metrics(router: RouterApp) -> str:
    return await scrape(router.metrics_url)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _healthy(_request: web.Request) -> web.StreamResponse:
    return web.json_response({})


@asynccontextmanager
async def scripted_engine(handler: Handler) -> AsyncIterator[str]:
    """A minimal engine on loopback whose completions answer is `handler`'s (what the simulator never does)."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/completions", handler)
    app.router.add_get("/health", _healthy)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def recording_decode(seen: list[dict[str, Any]]) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        seen.append({"body": body, "headers": dict(request.headers)})
        return web.json_response({"choices": [{"index": 0, "text": " ok", "finish_reason": "length"}]})

    return handler


# 1. Request ids --------------------------------------------------------------------------------------------------


async def test_concurrent_requests_with_one_client_id_never_collide_inside_the_engines(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    async with sim_in_process(role="prefill") as p, sim_in_process(role="decode") as d:
        config = make_config([p.url], [d.url], disaggregation_threshold_tokens=0)
        async with router_server(config) as (url, router):

            async def one(index: int) -> tuple[int, str, bytes]:
                body = {"model": "sim-model", "prompt": f"{index} {LONG}", "max_tokens": 4, "stream": True}
                status, headers, data = await post(url, body, {"X-Request-Id": "same-id"})
                return status, headers["X-Request-Id"], data

            answers = await asyncio.gather(*(one(index) for index in range(12)))
            # Counted as each handler ends, which may be just after its client read the last byte.
            exposition = await wait_for_metric(
                router.metrics_url, "pdserve_router_requests_total", 12, route="pd", outcome="success"
            )
    assert [status for status, _, _ in answers] == [200] * 12
    assert {rid for _, rid, _ in answers} == {"same-id"}  # the client's id comes back to the client
    assert all(data.count(b"data: {") == 4 for _, _, data in answers)
    assert metric_value(exposition, "pdserve_router_endpoint_errors_total") == 0
    assert metric_value(exposition, "pdserve_router_requests_total", route="pd", outcome="success") == 12


async def test_failures_a_client_causes_never_count_against_an_engine(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    async with sim_in_process(role="prefill") as p, sim_in_process(role="decode") as d:
        config = make_config([p.url], [d.url], breaker={"failure_threshold": 1})
        async with router_server(config) as (url, router):
            for body in (
                {"model": "unknown", "prompt": SHORT},  # decode-only: the engine's 404
                {"model": "unknown", "prompt": LONG},  # PD: the prefill engine's 404
                {"model": "sim-model", "prompt": LONG, "max_tokens": 10**7},  # past the context: decode's 400
            ):
                for _ in range(2):
                    status, _, _ = await post(url, body)
                    assert 400 <= status < 500
            exposition = await router_metrics(router)
            usable = [state.usable for role in ("prefill", "decode") for state in router.table.states(role)]
    assert metric_value(exposition, "pdserve_router_endpoint_errors_total") == 0
    assert usable == [True, True]


# 2. Timeouts -----------------------------------------------------------------------------------------------------


async def test_a_slow_non_streaming_answer_is_not_an_engine_failure(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    """An engine is silent until a non-streaming generation is done: that is not a stall."""
    # Decode only: a prefill engine would answer under the 0.2 s first-byte timeout, which a starved CPU can miss.
    async with sim_in_process(role="decode") as d:
        await set_faults(d.url, latency_s=1.0)
        config = make_config([], [d.url], read_timeout_seconds=0.2, first_byte_timeout_seconds=0.2)
        async with router_server(config) as (url, router):
            status, _, _ = await post(url, {"model": "sim-model", "prompt": LONG, "max_tokens": 3})
            exposition = await router_metrics(router)
        assert await requests_seen(d.url) == 1  # decode ran once: no retry repeated it
    assert status == 200
    assert metric_value(exposition, "pdserve_router_endpoint_errors_total") == 0


async def test_a_stream_stalled_before_its_first_byte_ends_after_the_first_byte_timeout(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    async with sim_in_process(role="decode") as d:
        await set_faults(d.url, latency_s=3600)
        config = make_config([], [d.url], first_byte_timeout_seconds=0.3, read_timeout_seconds=3600)
        async with router_server(config) as (url, router):
            status, _, body = await post(url, {"model": "sim-model", "prompt": SHORT, "max_tokens": 3, "stream": True})
            exposition = await router_metrics(router)
    assert status == 502, body
    assert metric_value(exposition, "pdserve_router_endpoint_errors_total", kind="timeout") == 2  # two attempts


async def test_the_request_deadline_is_a_504_and_no_engine_is_charged(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    async with sim_in_process(role="decode") as d:
        await set_faults(d.url, latency_s=3600)
        async with router_server(make_config([], [d.url], request_timeout_seconds=0.5)) as (url, router):
            status, _, body = await post(url, {"model": "sim-model", "prompt": SHORT, "max_tokens": 3})
            exposition = await router_metrics(router)
    assert status == 504
    assert orjson.loads(body)["error"]["type"] == "GatewayTimeoutError"
    assert metric_value(exposition, "pdserve_router_endpoint_errors_total") == 0


# 3. Ejection never empties a pool --------------------------------------------------------------------------------


async def test_errors_never_eject_the_last_engine_of_a_pool(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    breaker = {"failure_threshold": 2, "open_seconds": 60}
    async with sim_in_process(role="decode") as d:
        await set_faults(d.url, fail_next=4, fail_status=500)
        async with router_server(make_config([], [d.url], breaker=breaker)) as (url, router):
            statuses = [
                (await post(url, {"model": "sim-model", "prompt": SHORT, "max_tokens": 1}))[0] for _ in range(3)
            ]
            exposition = await router_metrics(router)
            assert router.table.states("decode")[0].usable
    # Two requests of two failing attempts each, then the engine is fine again and serves at once: no 503 for
    # the breaker's open_seconds, as there would be had errors ejected the only engine.
    assert statuses == [502, 502, 200]
    assert metric_value(exposition, "pdserve_router_endpoint_ejections_total") == 0


async def test_ejection_keeps_part_of_the_pool(router_server: Any, make_config: Callable[..., RouterConfig]) -> None:
    breaker = {"failure_threshold": 1, "open_seconds": 60}
    async with sim_in_process(role="decode") as d1, sim_in_process(role="decode") as d2:
        for engine in (d1, d2):
            await set_faults(engine.url, fail_next=100, fail_status=500)
        async with router_server(make_config([], [d1.url, d2.url], breaker=breaker)) as (url, router):
            status, _, _ = await post(url, {"model": "sim-model", "prompt": SHORT, "max_tokens": 1})
            usable = [state.usable for state in router.table.states("decode")]
            exposition = await router_metrics(router)
    assert status == 502
    assert sorted(usable) == [False, True]  # half the pool at most
    assert metric_value(exposition, "pdserve_router_endpoint_ejections_total") == 1


async def test_a_single_transient_failure_is_retried_on_the_only_engine(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    async with sim_in_process(role="decode") as d:
        await set_faults(d.url, fail_next=1, fail_status=500)
        async with router_server(make_config([], [d.url])) as (url, router):
            status, _, _ = await post(url, {"model": "sim-model", "prompt": SHORT, "max_tokens": 1})
            exposition = await router_metrics(router)
    assert status == 200
    assert metric_value(exposition, "pdserve_router_retries_total", stage="decode") == 1


# 4. Validate before prefill; record prefixes only on success --------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": -5}, "max_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"min_tokens": 9, "max_tokens": 2}, "min_tokens"),
        ({"n": 0}, "n"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"temperature": -1}, "temperature"),
        ({"prompt": None}, "prompt"),
    ],
)
async def test_requests_decode_would_refuse_never_reach_prefill(
    router_server: Any, make_config: Callable[..., RouterConfig], fields: dict[str, Any], param: str
) -> None:
    async with sim_in_process(role="prefill") as p, sim_in_process(role="decode") as d:
        async with router_server(make_config([p.url], [d.url])) as (url, _):
            status, _, body = await post(url, {"model": "sim-model", "prompt": LONG, **fields})
        assert status == 400, body
        error = orjson.loads(body)["error"]
        assert (error["type"], error["param"]) == ("BadRequestError", param)
        assert await requests_seen(p.url) == await requests_seen(d.url) == 0


async def test_a_prompt_counts_as_held_by_decode_only_once_decode_served_it(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    async with sim_in_process(role="prefill") as p, sim_in_process(role="decode") as d:
        async with router_server(make_config([p.url], [d.url])) as (url, _):
            # Prefill accepts it (it only makes one token), decode refuses it (past the context length).
            status, _, _ = await post(url, {"model": "sim-model", "prompt": LONG, "max_tokens": 10**7})
            assert status == 400
            status, headers, _ = await post(url, {"model": "sim-model", "prompt": LONG, "max_tokens": 2})
        local = metric_value(await scrape(d.url), "vllm:prompt_tokens_by_source_total", source="local_compute")
    assert status == 200
    assert headers["X-Pdserve-Route"] == "pd"  # decode never held the prompt, so it is not sent there to recompute
    assert local <= 1


# 5. kv_transfer_params in vllm_xargs -----------------------------------------------------------------------------


async def test_kv_transfer_params_inside_vllm_xargs_are_stripped(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    seen: list[dict[str, Any]] = []
    hostile = {"do_remote_prefill": True, "remote_host": "169.254.169.254", "remote_port": 80}
    async with (
        scripted_engine(recording_decode(seen)) as decode,
        router_server(make_config([], [decode])) as (url, _),
    ):
        body = {"model": "m", "prompt": SHORT, "vllm_xargs": {"kv_transfer_params": hostile, "tag": 1}}
        status, _, _ = await post(url, body)
    assert status == 200
    assert seen[0]["body"]["vllm_xargs"] == {"tag": 1}


# 7. Prefill answers are checked -----------------------------------------------------------------------------------


def hostile_prefill(params: dict[str, Any]) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": params})

    return handler


@pytest.mark.parametrize(
    "params",
    [
        pytest.param(
            {
                "do_remote_prefill": True,
                "remote_host": "127.0.0.1",
                "remote_port": 5600,
                "remote_block_ids": [list(range(2_000_000))],
            },
            id="15 MB",
        ),
        pytest.param(
            {"do_remote_prefill": True, "remote_host": "169.254.169.254", "remote_port": 80}, id="foreign host"
        ),
    ],
)
async def test_prefill_answers_a_decode_engine_must_not_act_on_never_reach_it(
    router_server: Any, make_config: Callable[..., RouterConfig], params: dict[str, Any]
) -> None:
    seen: list[dict[str, Any]] = []
    async with (
        scripted_engine(hostile_prefill(params)) as prefill,
        scripted_engine(recording_decode(seen)) as decode,
        router_server(make_config([prefill], [decode], max_prefill_attempts=1)) as (url, router),
    ):
        status, headers, _ = await post(url, {"model": "m", "prompt": LONG, "max_tokens": 2})
        exposition = await router_metrics(router)
    assert (status, headers["X-Pdserve-Route"]) == (200, "fallback")
    assert "kv_transfer_params" not in seen[0]["body"]
    assert metric_value(exposition, "pdserve_router_endpoint_errors_total", role="prefill", kind="protocol") == 1


# 8. Errors say what failed, not where -----------------------------------------------------------------------------


async def test_refusals_name_no_engine_and_no_exception(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    config = make_config(["http://127.0.0.1:9"], ["http://127.0.0.1:9"], fallback_to_decode=False)
    async with router_server(config) as (url, _):
        for prompt in (SHORT, LONG):
            status, _, body = await post(url, {"model": "m", "prompt": prompt})
            assert status == 503
            message = orjson.loads(body)["error"]["message"]
            assert "127.0.0.1" not in message and "Error" not in message and "errno" not in message.lower()
