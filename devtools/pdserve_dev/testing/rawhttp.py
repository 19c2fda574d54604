"""HTTP/1.1 on raw sockets for tests: write exactly the bytes a (hostile or odd) client would, read answers as
they come (interim `1xx` answers included), and tell a clean close from a reset."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

Answer = tuple[int, dict[str, str], bytes]


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """One status line and its headers (lower-case names)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return status, headers


async def read_response(reader: asyncio.StreamReader, *, interim: list[int] | None = None) -> Answer:
    """One final HTTP/1.1 answer (Content-Length, chunked, or until close). Interim 1xx answers before it are
    skipped, as every HTTP/1.1 client must, and their statuses appended to `interim` when given."""
    status, headers = await read_head(reader)
    while 100 <= status < 200:
        if interim is not None:
            interim.append(status)
        status, headers = await read_head(reader)
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                break
            body += chunk[:-2]
    else:
        body = await reader.read()
    return status, headers, body


@asynccontextmanager
async def connection(
    url: str, local_host: str | None = None
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A TCP connection to `url` (http://host:port), from `local_host` when given (e.g. 127.0.0.2)."""
    host, port = url.removeprefix("http://").split(":")
    local = (local_host, 0) if local_host else None
    reader, writer = await asyncio.open_connection(host, int(port), local_addr=local)
    try:
        yield reader, writer
    finally:
        writer.close()


async def send(url: str, raw: bytes, *, within: float = 10.0) -> Answer:
    """Write `raw` on a new connection and read one answer."""
    async with connection(url) as (reader, writer):
        writer.write(raw)
        await writer.drain()
        return await asyncio.wait_for(read_response(reader), within)


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    """Whether the server closed the connection (reads until EOF or a reset, bounded by the caller's timeout)."""
    try:
        while await reader.read(65536):
            pass
    except ConnectionResetError:
        pass
    return True


async def ends_cleanly(reader: asyncio.StreamReader) -> bool:
    """Reads until the server closes: True for a clean close (EOF), False for a reset."""
    try:
        while await reader.read(65536):
            pass
    except ConnectionResetError:
        return False
    return True
