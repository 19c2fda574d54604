"""The router against real engine simulators on loopback: the PD flow, selective routing, security, relay."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from pdserve.api.router_config import RouterConfig
from pdserve_dev.testing.metrics import metric_value, scrape, wait_for_metric
from pdserve_dev.testing.net import free_port
from pdserve_dev.testing.sim import requests_seen, set_faults, sim_in_process

pytestmark = pytest.mark.timeout(60)

LONG = "The history of the river valley settlements began with small farms. " * 30  # ~ 360 tokens
SHORT = "Say hi."


async def by_source(url: str, source: str) -> float:
    return metric_value(await scrape(url), "vllm:prompt_tokens_by_source_total", source=source)


async def test_pd_stream_goes_prefill_then_decode_and_decode_pulls_the_kv(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    async with sim_in_process(role="prefill") as p, sim_in_process(role="decode") as d:
        async with router_server(make_config([p.url], [d.url])) as (url, _), aiohttp.ClientSession() as session:
            body = {"model": "sim-model", "prompt": LONG, "max_tokens": 8, "stream": True}
            async with session.post(url + "/v1/completions", json=body) as response:
                text = await response.text()
                assert response.status == 200
                assert response.headers["X-Pdserve-Route"] == "pd"
                assert response.headers["X-Request-Id"]
            assert text.count("data: {") == 8
            assert text.endswith("data: [DONE]\n\n")
        assert await requests_seen(p.url) == 1
        assert await by_source(d.url, "external_kv_transfer") > 300
        assert await by_source(d.url, "local_compute") == 0


async def test_selective_disaggregation_sends_short_and_cached_prompts_straight_to_decode(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    engine_latency = 0.1  # every decode request waits this long in the engine before its first byte
    async with sim_in_process(role="prefill") as p, sim_in_process(role="decode") as d:
        await set_faults(d.url, latency_s=engine_latency)
        async with router_server(make_config([p.url], [d.url])) as (url, router), aiohttp.ClientSession() as session:
            routes = []
            for prompt in (SHORT, LONG, LONG + " And then?"):
                body = {"model": "sim-model", "prompt": prompt, "max_tokens": 2}
                async with session.post(url + "/v1/completions", json=body) as response:
                    assert response.status == 200, await response.text()
                    routes.append(response.headers["X-Pdserve-Route"])
            # The third prompt extends the second, which the decode engine now holds: only a few tokens are new.
            assert routes == ["decode-only", "pd", "decode-only"]
            exposition = await wait_for_metric(router.metrics_url, "pdserve_router_requests_total", 3)
        assert await requests_seen(p.url) == 1
        assert metric_value(exposition, "pdserve_router_requests_total", route="pd", outcome="success") == 1
        assert metric_value(exposition, "pdserve_router_requests_total", route="decode-only", outcome="success") == 2
        assert metric_value(exposition, "pdserve_router_routing_decision_seconds_count") == 3
        assert metric_value(exposition, "pdserve_router_time_to_first_token_seconds_count") == 3
        assert metric_value(exposition, "pdserve_router_added_latency_seconds_count") == 3
        # Added latency is TTFT minus the time spent waiting on engines, and each request waited at least
        # `engine_latency` in the decode engine: a model check that holds however loaded the machine is. The
        # router's own share must also be the smaller part of TTFT (sub-ms against 100 ms on an idle machine).
        added = metric_value(exposition, "pdserve_router_added_latency_seconds_sum")
        ttft = metric_value(exposition, "pdserve_router_time_to_first_token_seconds_sum")
        assert 0 < added <= ttft - 3 * engine_latency + 1e-6
        assert added < ttft / 2


async def test_client_kv_transfer_params_are_stripped(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    # If the decode engine saw these params it would try to pull KV from the named host and fail after ~5 s.
    hostile = {"do_remote_prefill": True, "remote_host": "127.0.0.9", "remote_port": 1, "remote_engine_id": "x",
               "remote_block_ids": [[1]], "remote_request_id": "r"}  # fmt: skip
    async with sim_in_process(role="decode") as d:
        async with router_server(make_config([], [d.url])) as (url, _), aiohttp.ClientSession() as session:
            body = {"model": "sim-model", "prompt": SHORT, "max_tokens": 2, "kv_transfer_params": hostile}
            async with session.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(3)) as response:
                assert response.status == 200
        assert await by_source(d.url, "external_kv_transfer") == 0
        assert await by_source(d.url, "local_compute") > 0


async def test_stream_relay_matches_the_engine(router_server: Any, make_config: Callable[..., RouterConfig]) -> None:
    """Decode-only through the router vs directly to the same engine: the same bytes, but for the time and the id
    (engines get ids the router makes)."""
    created = re.compile(rb'"created":\s*\d+|"id":"[^"]*"')
    async with (
        sim_in_process(role="decode") as d,
        router_server(make_config([], [d.url])) as (url, _),
        aiohttp.ClientSession() as session,
    ):
        body = {"model": "sim-model", "prompt": SHORT, "max_tokens": 20, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        outputs = []
        for base in (url, d.url):
            async with session.post(base + "/v1/completions", json=body, headers={"X-Request-Id": "same"}) as r:
                outputs.append(created.sub(b"", await r.read()))
        assert outputs[0] == outputs[1]
        assert outputs[0].count(b"data: ") == 22  # 20 tokens, usage, [DONE]


async def _odd_engine(request: web.Request) -> web.StreamResponse:
    """An engine whose stream is cut at awkward places: mid-event, mid-UTF-8 character, comments."""
    request.app[SEEN].append((request.headers.copy(), await request.json()))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Engine": "odd"})
    await response.prepare(request)
    for piece in ODD_PIECES:
        await response.write(piece)
        await asyncio.sleep(0.002)
    await response.write_eof()
    return response


SEEN = web.AppKey("seen", list[tuple[Any, Any]])
ODD_PIECES = [b": comment\n\n", b'data: {"text": "caf', "é".encode()[:1], "é".encode()[1:] + b'"}\n', b"\ndata: [DO",
              b"NE]\n\n"]  # fmt: skip


async def test_stream_bytes_and_headers_are_relayed_untouched(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    app = web.Application()
    app[SEEN] = []
    app.router.add_post("/v1/completions", _odd_engine)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        engine = f"http://127.0.0.1:{port}"
        async with router_server(make_config([], [engine])) as (url, _), aiohttp.ClientSession() as session:
            trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
            headers = {"Authorization": "Bearer sk-test", "X-Request-Id": "rid-7", "X-Custom": "not forwarded",
                       "Connection": "keep-alive, X-Hop", "X-Hop": "dropped", "Cookie": "session=1",
                       "X-Forwarded-For": "10.1.1.1", "traceparent": trace}  # fmt: skip
            body = {"model": "m", "prompt": "x", "stream": True}
            async with session.post(url + "/v1/completions", json=body, headers=headers) as response:
                data = await response.read()
                assert response.headers["Content-Type"] == "text/event-stream"
                assert "X-Engine" not in response.headers  # nothing about the engine reaches the client
                assert response.headers["X-Request-Id"] == "rid-7"
        assert data == b"".join(ODD_PIECES)
        seen_headers, seen_body = app[SEEN][0]
        assert seen_headers["Authorization"] == "Bearer sk-test"
        assert seen_headers["traceparent"] == headers["traceparent"]
        # Engines see an allow-list of client headers, and the router's own request id.
        for name in ("X-Custom", "X-Hop", "Cookie", "X-Forwarded-For"):
            assert name not in seen_headers
        assert seen_headers["X-Request-Id"] != "rid-7"
        assert seen_body == body
    finally:
        await runner.cleanup()


async def test_chat_pd_non_streaming(router_server: Any, make_config: Callable[..., RouterConfig]) -> None:
    async with sim_in_process(role="prefill") as p, sim_in_process(role="decode") as d:
        config = make_config([p.url], [d.url], disaggregation_threshold_tokens=0)
        async with router_server(config) as (url, _), aiohttp.ClientSession() as session:
            body = {"model": "sim-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
            async with session.post(url + "/v1/chat/completions", json=body) as response:
                answer = await response.json()
                assert response.headers["X-Pdserve-Route"] == "pd"
        assert answer["usage"]["completion_tokens"] == 4
        assert answer["choices"][0]["message"]["content"]
        assert await by_source(d.url, "external_kv_transfer") > 0


async def test_small_endpoints(router_server: Any, make_config: Callable[..., RouterConfig]) -> None:
    async with (
        sim_in_process(role="decode") as d,
        router_server(make_config([], [d.url])) as (url, router),
        aiohttp.ClientSession() as session,
    ):
        async with session.get(url + "/health") as response:
            assert response.status == 200
        async with session.get(url + "/ready") as response:
            assert response.status == 200
        async with session.get(url + "/v1/models") as response:
            assert [model["id"] for model in (await response.json())["data"]] == ["sim-model"]
        async with session.get(url + "/nope") as response:
            assert response.status == 404
            assert (await response.json())["error"]["code"] == 404
        async with session.post(url + "/v1/completions", data=b"{not json") as response:
            assert response.status == 400
            assert "JSON" in (await response.json())["error"]["message"]
        big = b'{"prompt": "' + b"x" * (router.config.max_request_body_bytes + 1) + b'"}'
        async with session.post(url + "/v1/completions", data=big) as response:
            assert response.status == 413
            assert (await response.json())["error"]["type"] == "RequestEntityTooLargeError"
        # An engine-side 4xx (unknown model) is relayed as it is.
        async with session.post(url + "/v1/completions", json={"model": "other", "prompt": "x"}) as response:
            assert response.status == 404
            assert "error" in await response.json()


async def test_models_are_asked_from_a_decode_engine_without_a_configured_name(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    async with sim_in_process(role="decode") as d:
        config = make_config([], [d.url]).model_copy(update={"served_model_name": ""})
        async with (
            router_server(config) as (url, _),
            aiohttp.ClientSession() as session,
            session.get(url + "/v1/models") as response,
        ):
            assert (await response.json())["data"][0]["id"] == "sim-model"


async def test_concurrent_streams_spread_over_decode_engines(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    # The test counts where 40 streams went; no deadline may take part. Router, engines and client share one
    # event loop here, and on a starved CPU a real 2 s connect or 5 s KV pull can pass before the loop gets to
    # it: an engine counted as failed, a retry (an extra request seen) or an ejection (one engine gets almost
    # nothing) would then decide the counts. So every deadline (the prefill's KV lease too) lies beyond the test's
    # own timeout.
    no_deadline = 120.0
    async with (
        sim_in_process(role="prefill", kv_lease_seconds=no_deadline) as p,
        sim_in_process(role="decode", kv_transfer_timeout_s=no_deadline) as d1,
        sim_in_process(role="decode", kv_transfer_timeout_s=no_deadline) as d2,
    ):
        config = make_config(
            [p.url],
            [d1.url, d2.url],
            disaggregation_threshold_tokens=0,
            connect_timeout_seconds=no_deadline,
            first_byte_timeout_seconds=no_deadline,
            read_timeout_seconds=no_deadline,
        )
        async with router_server(config) as (url, _), aiohttp.ClientSession() as session:

            async def one(i: int) -> int:
                body = {"model": "sim-model", "prompt": f"request {i} " * 5, "max_tokens": 16, "stream": True}
                async with session.post(url + "/v1/completions", json=body) as response:
                    return (await response.read()).count(b"data: {")

            counts = await asyncio.gather(*(one(i) for i in range(40)))
        assert counts == [16] * 40
        served = [await requests_seen(d1.url), await requests_seen(d2.url)]
        assert sum(served) == 40
        assert min(served) >= 10
