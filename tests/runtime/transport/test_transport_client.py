"""The engine client on raw sockets: framings, bounds, deadlines, and a pooled connection the engine had closed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from pdserve_runtime.transport.client import EngineClient, UpstreamError

pytestmark = pytest.mark.timeout(30)

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


@asynccontextmanager
async def raw_engine(script: Script) -> AsyncIterator[tuple[str, list[int]]]:
    """A loopback server running `script(reader, writer, connection number)` per connection."""
    connections: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(len(connections))
        try:
            await script(reader, writer, len(connections) - 1)
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", connections
    finally:
        server.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    return await reader.readexactly(length)


def deadline(seconds: float) -> float:
    return asyncio.get_running_loop().time() + seconds


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\nhello world",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nhello world",  # ends with the connection
    ],
)
async def test_every_framing_reads_whole(answer: bytes) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _n: int) -> None:
        assert await read_request(reader) == b'{"a":1}'
        writer.write(answer)
        await writer.drain()

    client = EngineClient(connect_timeout=1.0)
    async with raw_engine(script) as (url, _):
        exchange = await client.send(url, "POST", "/v1/completions", b"", [b'{"a":', memoryview(b"1}")])
        assert await exchange.read_all(1024, deadline(5)) == b"hello world"
        exchange.close()
    await client.close()


async def test_a_pooled_connection_the_engine_closed_unread_is_sent_again_on_a_fresh_one() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        if number == 0:
            await reader.readuntil(b"\r\n\r\n")  # the second request on this connection: closed unanswered
            return
        await read_request(reader)  # pragma: no cover (a fresh connection serves one request here)

    client = EngineClient(connect_timeout=1.0)
    async with raw_engine(script) as (url, connections):
        for _ in range(2):
            exchange = await client.send(url, "POST", "/", b"", [b"{}"])
            assert await exchange.first_chunk(deadline(5)) == b"ok"
            exchange.close()
        assert len(connections) == 2  # the second answer came on a new connection
    await client.close()


async def test_an_answer_over_the_bound_is_refused() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"x" * 100000)
        await writer.drain()

    client = EngineClient(connect_timeout=1.0)
    async with raw_engine(script) as (url, _):
        exchange = await client.send(url, "POST", "/", b"", [b"{}"])
        with pytest.raises(UpstreamError) as caught:
            await exchange.read_all(4096, deadline(5))
        assert caught.value.kind == "protocol"
        exchange.close()
    await client.close()


async def test_deadlines_first_byte_and_silence_between_chunks() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> None:
        await read_request(reader)
        if number == 0:
            await asyncio.sleep(30)  # never answers
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await asyncio.sleep(30)  # then goes quiet mid-answer

    client = EngineClient(connect_timeout=1.0)
    async with raw_engine(script) as (url, _):
        silent = await client.send(url, "POST", "/", b"", [b"{}"])
        with pytest.raises(UpstreamError) as caught:
            await silent.first_chunk(deadline(0.2))
        assert caught.value.kind == "timeout"
        silent.close()
        stalled = await client.send(url, "POST", "/", b"", [b"{}"])
        assert await stalled.first_chunk(deadline(5)) == b"first"
        relayed: list[bytes] = []
        with pytest.raises(UpstreamError) as caught:
            await stalled.relay(relayed.append, idle_timeout=0.2)
        assert caught.value.kind == "timeout"
        stalled.close()
    await client.close()


async def test_silence_while_the_caller_has_paused_reading_is_not_a_timeout() -> None:
    """The relay's reader being slow is not the engine's fault: paused, the idle timeout does not run (issue 18.7);
    resumed, it counts afresh."""
    go_on, sent = asyncio.Event(), asyncio.Event()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await go_on.wait()  # silent for as long as the test likes
        writer.write(b"4\r\nrest\r\n0\r\n\r\n")
        await writer.drain()
        sent.set()

    client = EngineClient(connect_timeout=1.0)
    async with raw_engine(script) as (url, _):
        exchange = await client.send(url, "POST", "/", b"", [b"{}"])
        assert await exchange.first_chunk(deadline(5)) == b"first"
        exchange.pause_reading()
        relayed: list[bytes] = []
        relay = asyncio.create_task(exchange.relay(relayed.append, idle_timeout=0.2))
        await asyncio.sleep(1.0)  # five idle timeouts: paused, there is no deadline at all
        assert not relay.done()
        # The rest is on the socket before reading resumes: the relay's next wake-up finds it there. (Resumed
        # first, a starved CPU could let the fresh 0.2 s pass before this shared event loop wrote the rest.)
        go_on.set()
        await asyncio.wait_for(sent.wait(), 5)
        exchange.resume_reading()
        await asyncio.wait_for(relay, 5)
        assert relayed == [b"rest"]
        exchange.close()
    await client.close()


async def test_a_refused_connection_is_a_connect_failure() -> None:
    client = EngineClient(connect_timeout=1.0)
    with pytest.raises(UpstreamError) as caught:
        await client.send("http://127.0.0.1:9", "POST", "/", b"", [b"{}"])
    assert caught.value.kind == "connect"
    await client.close()


async def test_a_forgotten_engine_gets_fresh_connections() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _n: int) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:  # keep-alive until the client closes the connection
                await read_request(reader)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()

    client = EngineClient(connect_timeout=1.0)
    async with raw_engine(script) as (url, connections):
        for forget in (False, True, False):
            if forget:
                client.forget(url)  # the pod at this address was replaced
            exchange = await client.send(url, "POST", "/", b"", [b"{}"])
            assert await exchange.read_all(64, deadline(5)) == b"ok"
            exchange.close()
        assert len(connections) == 2  # reused once, then a new connection after forget
    await client.close()
