"""The router process's memory under floods of request bodies stays under its body budget (issue 18.5: headers
announcing `Content-Length: 8388608` from 80 loopback addresses took the router to 2.86 GB of RSS with its
512 MiB budget, because it allocated what was announced and a dead connection's buffer stayed referenced through
a reference cycle until the cyclic collector ran).

The router runs as `pdserve router` does (its own process, uvloop, the collector frozen after start-up); its RSS is
read from /proc. A flood that overshoots stops at once, so a regression fails the test without exhausting the
machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import yaml

from pdserve_dev.testing.net import free_port
from pdserve_dev.testing.rawhttp import send
from pdserve_dev.testing.wait import wait_for_async

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

MIB = 1024 * 1024
ADDRESSES = [f"127.0.0.{n}" for n in range(2, 82)]  # 80 client addresses
HEADERS_ONLY = (
    b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nContent-Length: 8388608\r\n\r\n"
)


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    """Resident memory of process `pid` (VmRSS now, or VmHWM: its peak), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} for {pid}")


@contextlib.asynccontextmanager
async def router_process(tmp_path: Path, **settings: object) -> AsyncIterator[tuple[str, int]]:
    """`pdserve router` in front of nothing (a dead decode address): (base URL, PID)."""
    port = free_port()
    config = {"servedModelName": "m", "host": "127.0.0.1", "port": port, "metricsPort": free_port(), **settings}
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {key: value for key, value in os.environ.items() if key != "PDSERVE_BIND_HOST"}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pdserve.cli", "router", "--config", str(path), "--decode", "http://127.0.0.1:9",
        "--log-level", "warning", env=env,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:

        async def up() -> bool:
            with contextlib.suppress(OSError):
                return (await send(url, b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n"))[0] == 200
            return False

        await wait_for_async(up, within=30, message="the router process to answer /health")
        yield url, process.pid
    finally:
        process.terminate()
        try:
            await asyncio.wait_for(process.wait(), 10)
        except TimeoutError:
            process.kill()
            await process.wait()


async def uploads(url: str, address: str, connections: int, body: bytes = b"") -> list[asyncio.StreamWriter]:
    """`connections` uploads from `address`, each announcing 8 MiB and sending `body` of it, left open."""
    host, port = url.removeprefix("http://").split(":")
    opened = [await asyncio.open_connection(host, int(port), local_addr=(address, 0)) for _ in range(connections)]
    writers = [writer for _reader, writer in opened]
    for writer in writers:
        writer.write(HEADERS_ONLY + body)
    for writer in writers:
        with contextlib.suppress(ConnectionError):
            await writer.drain()
    # The router has read them once it answers this address again (it reads every ready socket in turn).
    with contextlib.suppress(OSError):
        await send(url, b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")
    return writers


def leave(writers: list[asyncio.StreamWriter]) -> None:
    for writer in writers:
        writer.close()


async def test_header_only_uploads_from_80_addresses_stay_under_the_budget(tmp_path: Path) -> None:
    budget_mib = 512  # the default maxBufferedBodyBytes
    async with router_process(tmp_path) as (url, pid):
        start = rss_mib(pid)
        for _round in range(3):
            for address in ADDRESSES:
                leave(await uploads(url, address, 8))
                assert rss_mib(pid) < budget_mib, f"RSS {rss_mib(pid):.0f} MiB after {address} (start {start:.0f})"
        assert (await send(url, b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n"))[0] == 200
        peak = rss_mib(pid, "VmHWM")
    assert peak < budget_mib
    # Nothing was announced into memory: far from the budget, not just under it.
    assert peak < start + 64, (start, peak)


async def test_bodies_that_arrive_from_80_addresses_stay_within_the_budget(tmp_path: Path) -> None:
    """Uploads that do send bytes hold at most the budget, however many they are, and give it back on leaving."""
    budget = 64 * MIB
    async with router_process(tmp_path, maxBufferedBodyBytes=budget, maxBufferedBodyBytesPerClient=budget) as (
        url,
        pid,
    ):
        start = rss_mib(pid)
        held: list[asyncio.StreamWriter] = []
        try:
            for address in ADDRESSES:  # 80 x 2 uploads of 1 MiB, all open: 160 MiB offered to a 64 MiB budget
                held += await uploads(url, address, 2, body=b"x" * MIB)
                assert rss_mib(pid) < start + budget / MIB + 32, f"RSS {rss_mib(pid):.0f} MiB after {address}"
        finally:
            leave(held)
        assert (await send(url, b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n"))[0] == 200
        peak = rss_mib(pid, "VmHWM")
    assert peak < start + budget / MIB + 32, (start, peak)
