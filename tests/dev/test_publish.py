"""Publishing a private namespace's services on this namespace's loopback (`pdserve_dev.publish`,
`pdserve_dev.demo_access`), over real sockets.

The relays are tested on their own (bytes, half-close, a target that moves or is gone, closing), and the whole
protocol of a kept demo across two real network namespaces: a stand-in demo (an HTTP server and the inner relays,
no cluster) started by `run_isolated` in a fresh namespace, reached from this one through the published port.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import yaml

from pdserve_dev import publish
from pdserve_dev.cluster import netns
from pdserve_dev.demo_access import Access, Kept, banner, published_access
from pdserve_dev.testing.wait import wait_for

pytestmark = pytest.mark.timeout(60)


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Echo everything, upper-cased, then close once the client has half-closed."""
    while chunk := await reader.read(65536):
        writer.write(chunk.upper())
        await writer.drain()
    writer.close()


@contextlib.asynccontextmanager
async def echo_server() -> AsyncIterator[tuple[str, int]]:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    try:
        yield "127.0.0.1", server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


@contextlib.asynccontextmanager
async def published(targets: dict[str, publish.Target], directory: Path) -> AsyncIterator[publish.Relays]:
    inner = await publish.serve_inner(targets, directory)
    outer = await publish.serve_outer(inner.paths)
    try:
        yield outer
    finally:
        await outer.close()
        await inner.close()


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def test_bytes_pass_both_ways_and_a_half_close_still_gets_its_answer(tmp_path: Path) -> None:
    payload = os.urandom(3 * 1024 * 1024).hex().encode()  # 6 MiB of [0-9a-f]: many chunks, every byte checked
    async with echo_server() as address, published({"echo": publish.Target("echo", address)}, tmp_path) as outer:
        reader, writer = await asyncio.open_connection("127.0.0.1", outer.ports["echo"])

        async def send() -> None:
            writer.write(payload)
            await writer.drain()
            writer.write_eof()  # the client is done sending; the answer must still arrive in full

        sent = asyncio.ensure_future(send())
        answer = await reader.read(-1)  # until the echo server closes, relayed as the end of stream
        await sent
        writer.close()
    assert answer == payload.upper()
    assert (tmp_path / "echo.sock").is_socket()


async def test_the_socket_folder_is_private(tmp_path: Path) -> None:
    async with echo_server() as address, published({"a": publish.Target("a", address)}, tmp_path / "publish"):
        assert (tmp_path / "publish").stat().st_mode & 0o777 == 0o700


async def test_a_target_that_refuses_is_looked_up_again_once(tmp_path: Path) -> None:
    lookups: list[int] = []
    async with echo_server() as address:

        def lookup() -> list[publish.Address]:
            lookups.append(1)
            return [address]

        # The pod behind the first address is gone (nothing listens there): the relay asks where it is now.
        target = publish.Target("router", ("127.0.0.1", _closed_port()), lookup)
        async with published({"router": target}, tmp_path) as outer:
            for _ in range(3):
                reader, writer = await asyncio.open_connection("127.0.0.1", outer.ports["router"])
                writer.write(b"ping")
                writer.write_eof()
                assert await reader.read(-1) == b"PING"
                writer.close()
    assert len(lookups) == 1  # then the new address is the one used


async def test_every_looked_up_address_is_tried_in_turn(tmp_path: Path) -> None:
    """Mid-rollout the pod going away can still be listed as Ready before its successor: its address refuses, the
    next one serves, and is the one kept."""
    async with echo_server() as address:
        gone = ("127.0.0.1", _closed_port())
        target = publish.Target("router", ("127.0.0.1", _closed_port()), lambda: [gone, address])
        async with published({"router": target}, tmp_path) as outer:
            reader, writer = await asyncio.open_connection("127.0.0.1", outer.ports["router"])
            writer.write(b"ping")
            writer.write_eof()
            assert await reader.read(-1) == b"PING"
            writer.close()
        assert target.address == address


async def test_a_local_relay_follows_its_target_to_the_replacement() -> None:
    """`serve_local`, a Service's stand-in in one namespace: connections go to the target's address while it
    serves, and to where the lookup says it is now once it refuses (the old pod stopped listening)."""

    async def ping(relays: publish.Relays) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", relays.ports["router"])
        writer.write(b"ping")
        writer.write_eof()
        answer = await reader.read(-1)
        writer.close()
        return answer

    where: list[publish.Address] = []
    async with echo_server() as old:
        target = publish.Target("router", old, lambda: list(where))
        async with echo_server() as new:
            where.append(new)
            relays = await publish.serve_local({"router": target})
            try:
                assert await ping(relays) == b"PING" and target.address == old  # still serving: kept
            finally:
                await relays.close()
    relays = await publish.serve_local({"router": target})
    async with echo_server() as replacement:
        where[:] = [replacement]
        try:
            assert await ping(relays) == b"PING" and target.address == replacement  # gone: looked up
        finally:
            await relays.close()


async def test_an_unreachable_target_closes_the_client_connection_at_once(tmp_path: Path) -> None:
    target = publish.Target("gone", ("127.0.0.1", _closed_port()), list)
    async with published({"gone": target}, tmp_path) as outer:
        reader, writer = await asyncio.open_connection("127.0.0.1", outer.ports["gone"])
        with contextlib.suppress(ConnectionError):
            assert await reader.read(-1) == b""
        writer.close()


async def test_closed_relays_stop_listening(tmp_path: Path) -> None:
    async with echo_server() as address:
        async with published({"echo": publish.Target("echo", address)}, tmp_path) as outer:
            port = outer.ports["echo"]
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", port)


def test_the_banner_prints_only_published_addresses_and_a_kubeconfig_for_them(tmp_path: Path) -> None:
    inner = tmp_path / "inner-kubeconfig"
    inner.write_text(yaml.safe_dump({"clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:6443"}}]}))
    kept = Kept(str(tmp_path), str(inner), {}, "demo", "demo", "tiny-llama", "/logs/*.log")
    outer = publish.Relays()
    outer.ports = {"router": 41001, "prometheus": 41002, "apiserver": 41003}
    access = published_access(kept, outer)
    assert access == Access(
        "http://127.0.0.1:41001",
        "http://127.0.0.1:41002",
        "https://127.0.0.1:41003",
        str(tmp_path / "kubeconfig"),
        str(tmp_path / "env"),
    )
    config = yaml.safe_load(Path(access.kubeconfig).read_text())
    assert config["clusters"][0]["cluster"]["server"] == "https://127.0.0.1:41003"
    assert Path(access.kubeconfig).stat().st_mode & 0o777 == 0o600
    env = Path(access.env_file).read_text()
    assert f"export KUBECONFIG={access.kubeconfig}\n" in env and "OPENAI_BASE_URL=http://127.0.0.1:41001/v1" in env
    text = banner(kept, access, "kubectl")
    assert set(re.findall(r"\d+\.\d+\.\d+\.\d+:\d+", text)) == {"127.0.0.1:41001", "127.0.0.1:41002", "127.0.0.1:41003"}


# A stand-in for the demo inside its namespace: an HTTP server on this namespace's loopback, the inner relays, the
# message to the process outside, then serving until SIGTERM (as the demo does).
STAND_IN = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from pdserve_dev import publish
    from pdserve_dev.demo_access import Kept, control_fd, publish_inside, stop_on_signals

    workdir = Path(sys.argv[1])

    async def answer(reader, writer):
        await reader.readuntil(b"\\r\\n\\r\\n")
        body = b"hello from inside"
        head = b"HTTP/1.1 200 OK\\r\\nContent-Length: %d\\r\\nConnection: close\\r\\n\\r\\n" % len(body)
        writer.write(head + body)
        await writer.drain()
        writer.close()

    async def main():
        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        (workdir / "inner-port").write_text(str(port))
        kept = Kept(str(workdir), str(workdir / "inner-kubeconfig"), {}, "demo", "demo", "m", "/logs")
        targets = {name: publish.Target(name, ("127.0.0.1", port)) for name in ("router", "prometheus", "apiserver")}
        await publish_inside(kept, targets, control)

    control = control_fd()
    stop_on_signals()
    print("stand-in ready", flush=True)
    asyncio.run(main())
    (workdir / "stopped").write_text("yes")
    sys.exit(130)
    """
)

OUTSIDE = textwrap.dedent(
    """
    import sys
    from pdserve_dev.demo_access import run_isolated
    sys.exit(run_isolated([sys.executable, "-c", sys.argv[1], sys.argv[2]], print))
    """
)


@pytest.fixture
def isolated_stand_in(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], list[str]]]:
    if not netns.can_isolate():
        pytest.skip("needs to create network namespaces (root)")
    (tmp_path / "inner-kubeconfig").write_text(yaml.safe_dump({"clusters": [{"cluster": {"server": "https://x:1"}}]}))
    proc = subprocess.Popen(
        [sys.executable, "-c", OUTSIDE, STAND_IN, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("Ctrl-C stops everything"):
            break
    try:
        yield proc, lines
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def test_a_kept_demo_is_reached_from_the_namespace_it_was_started_in(
    isolated_stand_in: tuple[subprocess.Popen[str], list[str]], tmp_path: Path
) -> None:
    proc, lines = isolated_stand_in
    text = "".join(lines)
    match = re.search(r"OpenAI API \(router\)  http://127\.0\.0\.1:(\d+)/v1", text)
    assert match is not None, text
    inner = int((tmp_path / "inner-port").read_text())
    # The stand-in's server exists only in its namespace: here its port is closed (or someone else's) ...
    with socket.socket() as direct, contextlib.suppress(OSError):
        direct.settimeout(5)
        direct.connect(("127.0.0.1", inner))
        direct.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"hello from inside" not in direct.recv(4096)
    # ... and the published port reaches it.
    with socket.create_connection(("127.0.0.1", int(match[1])), timeout=10) as client:
        client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while chunk := client.recv(4096):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 OK") and answer.endswith(b"hello from inside")
    config = yaml.safe_load((tmp_path / "kubeconfig").read_text())
    assert config["clusters"][0]["cluster"]["server"].startswith("https://127.0.0.1:")

    # Ctrl-C in the terminal: the whole foreground group gets SIGINT; the demo stops once, the relays close.
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=30) == 130
    assert (tmp_path / "stopped").read_text() == "yes"
    rest = proc.stdout.read() if proc.stdout else ""
    assert "Traceback" not in rest, rest
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", int(match[1])), timeout=5).close()


def test_a_signal_to_the_process_outside_alone_stops_the_demo_inside(
    isolated_stand_in: tuple[subprocess.Popen[str], list[str]], tmp_path: Path
) -> None:
    proc, _ = isolated_stand_in
    proc.send_signal(signal.SIGTERM)  # not the group: only what `run_isolated` passes on reaches the demo
    assert proc.wait(timeout=30) == 130
    assert (tmp_path / "stopped").read_text() == "yes"


def test_the_demo_inside_stops_when_the_process_outside_is_killed(
    isolated_stand_in: tuple[subprocess.Popen[str], list[str]], tmp_path: Path
) -> None:
    proc, _ = isolated_stand_in
    proc.kill()  # SIGKILL: nothing of it runs again; the kernel tells the demo (PR_SET_PDEATHSIG)
    proc.wait(timeout=30)
    wait_for((tmp_path / "stopped").exists, timeout=30, message="the demo inside kept running")
