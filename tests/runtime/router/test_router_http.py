"""The router's HTTP server on raw sockets: what a hostile or odd client can send, and what it gets back.

Every refusal is an OpenAI-shaped JSON error that never quotes the input, and costs one log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from pdserve.api.router_config import RouterConfig
from pdserve_dev.testing.rawhttp import closed_by_server, connection, read_response, send
from pdserve_dev.testing.sim import sim_in_process
from pdserve_dev.testing.wait import wait_for_async

pytestmark = pytest.mark.timeout(60)

DEAD = "http://127.0.0.1:9"
SECRET = "s3cr3t-input-marker"


def assert_openai_error(status: int, headers: dict[str, str], body: bytes, expected: int) -> dict[str, Any]:
    assert status == expected, body
    assert headers["content-type"] == "application/json"
    error = orjson.loads(body)["error"]
    assert error["code"] == expected and error["message"]
    assert SECRET.encode() not in body  # the input is never echoed
    return dict(error)


POST = b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        # Request smuggling: both framings, or a Transfer-Encoding the router would have to undo.
        (POST + b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
        (POST + b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", 501),
        (POST + b"Transfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n", 400),
        (POST + b"Transfer-Encoding : chunked\r\n\r\n0\r\n\r\n", 400),
        (POST + b"Content-Length: 4\r\nContent-Length: 5\r\n\r\nabcd", 400),
        # Bad chunked framing, with the input in it.
        (POST + b"Transfer-Encoding: chunked\r\n\r\n" + SECRET.encode() + b"\r\nxx\r\n0\r\n\r\n", 400),
        # Obsolete line folding, a bad request line.
        (POST + b"X-A: 1\r\n folded: " + SECRET.encode() + b"\r\n\r\n", 400),
        (b"GET /" + SECRET.encode() + b" HTTP/1.1 junk\r\n\r\n", 400),
        # Protocol switches are not offered.
        (b"GET /health HTTP/1.1\r\nHost: r\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n", 400),
        # Compressed bodies would cost the router CPU a client controls.
        (POST + b"Content-Encoding: gzip\r\nContent-Length: 2\r\n\r\n{}", 415),
        (POST + b"Expect: something-else\r\nContent-Length: 2\r\n\r\n{}", 417),
        # A body over the limit is refused from its Content-Length, before it is read.
        (POST + b"Content-Length: 999999999\r\n\r\n", 413),
    ],
)
async def test_parser_level_refusals_are_openai_errors_without_echo_and_one_log_line(
    router_server: Any,
    make_config: Callable[..., RouterConfig],
    caplog: pytest.LogCaptureFixture,
    raw: bytes,
    status: int,
) -> None:
    async with router_server(make_config([], [DEAD])) as (url, _):
        with caplog.at_level(logging.INFO, logger="pdserve.transport"):
            got, headers, body = await send(url, raw)
    assert_openai_error(got, headers, body, status)
    assert headers["connection"] == "close"
    records = [record for record in caplog.records if record.name.startswith("pdserve.transport.server")]
    assert len(records) == 1
    assert records[0].exc_info is None and "\n" not in records[0].getMessage()
    assert SECRET not in records[0].getMessage()


async def test_oversize_headers_are_refused_with_431(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    async with router_server(make_config([], [DEAD])) as (url, _):
        # 120 headers of 8 KB each: about 1 MB of headers.
        many = b"".join(b"X-Big-%d: %s\r\n" % (index, b"a" * 8000) for index in range(120))
        status, headers, body = await send(url, b"GET /health HTTP/1.1\r\nHost: r\r\n" + many + b"\r\n")
        assert_openai_error(status, headers, body, 431)
        # One header line that never ends is cut off at the limit too.
        async with connection(url) as (reader, writer):
            writer.write(b"GET /health HTTP/1.1\r\nX-Endless: " + b"a" * 200_000)
            await writer.drain()
            status, headers, body = await asyncio.wait_for(read_response(reader), 10)
        assert_openai_error(status, headers, body, 431)
        # Within the limit all is well.
        status, _, _ = await send(url, b"GET /health HTTP/1.1\r\nHost: r\r\nX-Small: " + b"a" * 4000 + b"\r\n\r\n")
        assert status == 200


async def test_slow_headers_are_cut_off(router_server: Any, make_config: Callable[..., RouterConfig]) -> None:
    """Slowloris: a client trickling its headers is answered 408 and closed after the header timeout."""
    async with router_server(make_config([], [DEAD], header_timeout_seconds=0.5)) as (url, _):
        async with connection(url) as (reader, writer):
            writer.write(b"GET /health HTTP/1.1\r\nHost: r\r\n")
            for _ in range(3):
                writer.write(b"X-Drip: 1\r\n")
                await writer.drain()
            status, headers, body = await asyncio.wait_for(read_response(reader), 10)
            assert_openai_error(status, headers, body, 408)
            assert await closed_by_server(reader)
        # A connection that never sends anything is closed the same way.
        async with connection(url) as (reader, _writer):
            assert await asyncio.wait_for(closed_by_server(reader), 10)


async def test_a_body_that_does_not_arrive_in_time_is_a_408(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    async with router_server(make_config([], [DEAD], body_timeout_seconds=0.5)) as (url, router):
        async with connection(url) as (reader, writer):
            writer.write(POST + b"Content-Length: 1000\r\n\r\n" + b"x" * 10)
            await writer.drain()
            status, headers, body = await asyncio.wait_for(read_response(reader), 10)
        assert_openai_error(status, headers, body, 408)
        assert router.server.budget.total == 0  # the reservation went back


async def test_the_connection_limit_answers_503(router_server: Any, make_config: Callable[..., RouterConfig]) -> None:
    async with router_server(make_config([], [DEAD], max_connections=3)) as (url, _):
        held = [await asyncio.open_connection(*url.removeprefix("http://").split(":")) for _ in range(3)]
        try:
            for _reader, writer in held:
                writer.write(b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")
            for reader, _writer in held:
                assert (await read_response(reader))[0] == 200  # the three are served, and stay open
            status, headers, body = await send(url, b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")
            assert_openai_error(status, headers, body, 503)
            assert headers["retry-after"]
        finally:
            for _reader, writer in held:
                writer.close()


async def test_request_memory_is_bounded_per_client_address(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    """Uploads from one client address take its share of the body budget, not everyone's."""
    config = make_config(
        [],
        [DEAD],
        max_buffered_body_bytes_per_client=100_000,
        max_buffered_body_bytes=10_000_000,
        body_timeout_seconds=30,
    )
    async with router_server(config) as (url, router):
        async with connection(url, "127.0.0.1") as (r1, w1), connection(url, "127.0.0.1") as (r2, w2):
            w1.write(POST + b"Content-Length: 90000\r\n\r\n" + b"{" * 70_000)  # an upload holding 70 kB, stalled
            await w1.drain()
            await wait_for_async(lambda: asyncio.sleep(0, router.server.budget.total >= 70_000), within=10)
            # Another client address is not affected by the first one's uploads.
            async with connection(url, "127.0.0.2") as (r3, w3):
                w3.write(POST + b"Content-Length: 80000\r\n\r\n" + b"{" * 80000)
                await w3.drain()
                status, _, body = await asyncio.wait_for(read_response(r3), 10)
            assert status == 400  # read in full and parsed (it is not JSON): not refused for memory
            # On the same address, a request within its share (half the bound, beside the stalled upload) takes
            # memory from the upload above its share, which is refused: it cannot lock the address out.
            w2.write(POST + b"Content-Length: 40000\r\n\r\n" + b"{" * 40_000)
            status, headers, body = await asyncio.wait_for(read_response(r1), 10)
            assert_openai_error(status, headers, body, 429)
            status, _, body = await asyncio.wait_for(read_response(r2), 10)
            assert status == 400  # read in full
        # Closing the uploads gives their bytes back.
        assert await wait_for_async(lambda: asyncio.sleep(0, router.server.budget.total == 0), within=10)


async def test_header_only_uploads_do_not_lock_their_address_out(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    """Issue 18.6: eight uploads announcing 8 MiB and sending nothing gave every other request from their address a
    429 for the 30 s body timeout. Announced bytes cost nothing now; behind a proxy everyone shares that address."""
    async with (
        sim_in_process(role="decode") as d,
        router_server(make_config([], [d.url])) as (url, router),
        contextlib.AsyncExitStack() as stack,
    ):
        for _ in range(8):
            _reader, writer = await stack.enter_async_context(connection(url, "127.0.0.2"))
            writer.write(POST + b"Content-Length: 8388608\r\n\r\n")
            await writer.drain()

        def announced() -> bool:
            return sum(1 for conn in router.server.connections if conn.headers_done) == 8

        await wait_for_async(lambda: asyncio.sleep(0, announced()), within=10, message="eight uploads read")
        body = orjson.dumps({"model": "sim-model", "prompt": "hi", "max_tokens": 2})
        async with connection(url, "127.0.0.2") as (reader, writer):
            writer.write(POST + b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
            status, _, answer = await asyncio.wait_for(read_response(reader), 10)
        assert status == 200, answer
        assert router.server.budget.total == 0


async def test_keep_alive_pipelining_expect_head_and_http10(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    async with sim_in_process(role="decode") as d, router_server(make_config([], [d.url])) as (url, _):
        body = orjson.dumps({"model": "sim-model", "prompt": "hi", "max_tokens": 2})
        request = POST + b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        async with connection(url) as (reader, writer):
            # Two pipelined requests on one connection, answered in order.
            writer.write(request + b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")
            first = await read_response(reader)
            second = await read_response(reader)
            assert first[0] == 200 and orjson.loads(first[2])["choices"]
            assert second[0] == 200 and second[2] == b'{"status":"ok"}'
            # Expect: 100-continue gets its interim answer before the body is sent.
            writer.write(POST + b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body))
            assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.write(body)
            assert (await read_response(reader))[0] == 200
            # A chunked request body is read like any other.
            writer.write(POST + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
            assert (await read_response(reader))[0] == 200
        async with connection(url) as (reader, writer):
            writer.write(b"HEAD /health HTTP/1.1\r\nHost: r\r\n\r\n")
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200") and b"Content-Length: 15" in head
            writer.write(b"GET /health HTTP/1.0\r\n\r\n")
            status, headers, body_10 = await read_response(reader)
            assert status == 200 and body_10 == b'{"status":"ok"}'
            assert headers.get("connection") == "close"
            assert await closed_by_server(reader)


async def test_unknown_paths_and_methods(router_server: Any, make_config: Callable[..., RouterConfig]) -> None:
    async with router_server(make_config([], [DEAD])) as (url, _):
        status, headers, body = await send(url, b"GET /nope HTTP/1.1\r\nHost: r\r\n\r\n")
        assert_openai_error(status, headers, body, 404)
        status, headers, body = await send(url, b"DELETE /v1/completions HTTP/1.1\r\nHost: r\r\n\r\n")
        assert_openai_error(status, headers, body, 405)
        assert headers["allow"] == "POST"


async def test_header_names_are_written_in_their_usual_spelling(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    """Header names are case-insensitive, but clients that read headers into a plain dict (urllib's response
    headers in `dict()`) look them up by their usual spelling."""
    async with sim_in_process(role="decode") as d, router_server(make_config([], [d.url])) as (url, _):
        body = orjson.dumps({"model": "sim-model", "prompt": "hi", "max_tokens": 2, "stream": True})
        async with connection(url) as (reader, writer):
            writer.write(POST + b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    for line in (b"X-Pdserve-Route: decode-only", b"Content-Type: text/event-stream", b"Transfer-Encoding: chunked"):
        assert b"\r\n" + line in head, head
    assert b"\r\nX-Request-Id: " in head


async def test_metrics_are_served_on_their_own_port_only(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    """Issue 18.9: `/metrics` on the client port listed every engine URL to anonymous clients."""
    async with sim_in_process(role="decode") as d, router_server(make_config([], [d.url])) as (url, router):
        status, headers, body = await send(url, b"GET /metrics HTTP/1.1\r\nHost: r\r\n\r\n")
        assert_openai_error(status, headers, body, 404)
        assert d.url.encode() not in body
        status, headers, body = await send(router.metrics_url, b"GET /metrics HTTP/1.1\r\nHost: r\r\n\r\n")
        assert status == 200 and headers["content-type"].startswith("text/plain")
        assert b"pdserve_router_endpoint_up{" in body
        # The metrics port serves nothing else.
        status, _, _ = await send(router.metrics_url, b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")
        assert status == 404
    assert router.metrics_port not in (0, router.port)


async def test_request_ids_say_nothing_about_other_requests(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    """Issue 18.9: the id the router made was a per-process prefix and a router-wide counter."""
    async with sim_in_process(role="decode") as d, router_server(make_config([], [d.url])) as (url, _):
        body = orjson.dumps({"model": "sim-model", "prompt": "hi", "max_tokens": 1})
        ids, engine_ids = [], []
        async with connection(url) as (reader, writer):
            for _ in range(20):
                writer.write(POST + b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
                status, headers, answer = await asyncio.wait_for(read_response(reader), 10)
                assert status == 200
                ids.append(headers["x-request-id"])
                engine_ids.append(orjson.loads(answer)["id"])  # vLLM (and the simulator) name it after the engine's id
    tokens = [rid.removeprefix("pdr-") for rid in ids]
    assert all(len(token) == 24 and int(token, 16) >= 0 for token in tokens)
    # 96 random bits each: no shared prefix, no order.
    assert len({token[:6] for token in tokens}) == len(tokens)
    assert all(token in engine_id for token, engine_id in zip(tokens, engine_ids, strict=True))
