"""Content codings between client, router and engines: the router forwards bodies it has decoded itself.

Two ways to get this wrong, both seen on real sockets here:
- a client's `Content-Encoding: gzip` request is decompressed by the router's HTTP server, so forwarding that
  header labels a plain body as gzip: the engine cannot read it, answers 500, and the router counts that against
  the engine (enough such requests eject every engine);
- the router's HTTP client asks engines for gzip by default while the router drops `Content-Encoding` on the way
  back (and parses prefill answers as JSON), so a compressing engine's bytes reach the client undecodable.
"""

from __future__ import annotations

import gzip
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from pdserve.api.router_config import RouterConfig
from pdserve_dev.testing.metrics import metric_value, wait_for_metric
from pdserve_dev.testing.sim import sim_in_process

pytestmark = pytest.mark.timeout(60)

LONG = "The history of the river valley settlements began with small farms. " * 30  # ~ 360 tokens
SHORT = "Say hi."
KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p", "remote_block_ids": [[1]]}


@asynccontextmanager
async def compressing_engine(seen: list[dict[str, Any]]) -> AsyncIterator[str]:
    """A minimal OpenAI-ish engine that compresses every answer whenever the request allows it (aiohttp's
    `enable_compression` honours Accept-Encoding), and records each request's headers and body."""

    async def completions(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        seen.append({"headers": dict(request.headers), "body": body})
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):
            answer: dict[str, Any] = {"choices": [{"text": "x"}], "kv_transfer_params": KV}
        else:
            answer = {"choices": [{"text": "hello " * 40}], "kv_transfer_params": None}
        response = web.json_response(answer)
        response.enable_compression()
        return response

    async def models(_request: web.Request) -> web.StreamResponse:
        response = web.json_response({"object": "list", "data": [{"id": "m" * 200, "object": "model"}]})
        response.enable_compression()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("prompt, route", [(SHORT, "decode-only"), (LONG, "pd")])
async def test_a_gzip_request_body_reaches_the_engines_readable(
    router_server: Any, make_config: Callable[..., RouterConfig], prompt: str, route: str
) -> None:
    async with sim_in_process(role="prefill") as p, sim_in_process(role="decode") as d:
        async with router_server(make_config([p.url], [d.url])) as (url, _), aiohttp.ClientSession() as session:
            raw = gzip.compress(orjson.dumps({"model": "sim-model", "prompt": prompt, "max_tokens": 2}))
            headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
            async with session.post(url + "/v1/completions", data=raw, headers=headers) as response:
                assert response.status == 200, await response.text()
                assert response.headers["X-Pdserve-Route"] == route
                assert (await response.json())["choices"][0]["text"]
            exposition = await wait_for_metric(url, "pdserve_router_requests_total", 1)
        # Once the request is counted as done: the client's encoding is no engine's fault, nothing is counted
        # against (or ejects) an engine.
        assert metric_value(exposition, "pdserve_router_endpoint_errors_total") == 0


async def test_compressing_engines_do_not_reach_the_client_compressed(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    seen: list[dict[str, Any]] = []
    async with compressing_engine(seen) as p, compressing_engine(seen) as d:
        # No configured model name: /v1/models is relayed from a decode engine.
        config = make_config([p], [d], disaggregation_threshold_tokens=0).model_copy(update={"served_model_name": ""})
        async with router_server(config) as (url, _), aiohttp.ClientSession(auto_decompress=False) as session:
            body = {"model": "m", "prompt": SHORT, "max_tokens": 2}
            async with session.post(url + "/v1/completions", json=body) as response:
                raw = await response.read()
                assert response.status == 200
                assert response.headers["X-Pdserve-Route"] == "pd"  # the prefill answer was readable
                assert "Content-Encoding" not in response.headers
            assert orjson.loads(raw)["choices"][0]["text"].startswith("hello")
            async with session.get(url + "/v1/models") as response:
                raw = await response.read()
                assert response.status == 200
            assert orjson.loads(raw)["data"][0]["id"] == "m" * 200
    prefill, decode = seen
    assert prefill["body"]["kv_transfer_params"]["do_remote_decode"] is True
    assert decode["body"]["kv_transfer_params"] == KV
    for request in seen:
        assert request["headers"].get("Accept-Encoding", "identity") == "identity"


async def test_an_undecodable_gzip_body_is_a_400_in_openai_shape(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    async with sim_in_process(role="decode") as d:
        async with router_server(make_config([], [d.url])) as (url, _), aiohttp.ClientSession() as session:
            raw = orjson.dumps({"model": "sim-model", "prompt": SHORT})  # labelled gzip, but it is not
            headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
            async with session.post(url + "/v1/completions", data=raw, headers=headers) as response:
                assert response.status == 400
                error = (await response.json())["error"]
        assert error["type"] == "BadRequestError"
        assert "gzip" in error["message"]
