"""The shared test helpers behave as the tests rely on: a failed assertion is never retried, a wait that times out
is a test failure, a counted event is waited for on a real server's exposition."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from pdserve_dev.testing import net
from pdserve_dev.testing.metrics import series, wait_for_metric
from pdserve_dev.testing.net import free_port, free_ports, http_ok, listening
from pdserve_dev.testing.prometheus import bool_comparisons
from pdserve_dev.testing.wait import WaitTimeoutError, wait_for, wait_for_async

pytestmark = pytest.mark.timeout(30)


def test_wait_for_lets_a_failed_assertion_through_at_once() -> None:
    calls = 0

    def verdict() -> bool:
        nonlocal calls
        calls += 1
        raise AssertionError("wrong answer")

    with pytest.raises(AssertionError, match="wrong answer"):
        wait_for(verdict, timeout=10)
    assert calls == 1


def test_wait_for_retries_other_errors_and_fails_the_test_on_timeout() -> None:
    def refused() -> bool:
        raise ConnectionRefusedError

    with pytest.raises(WaitTimeoutError, match="the server") as raised:
        wait_for(refused, timeout=0.2, interval=0.05, message="the server")
    assert isinstance(raised.value, AssertionError)
    assert "ConnectionRefusedError" in str(raised.value)


async def test_wait_for_async_returns_the_first_truthy_value() -> None:
    values = iter([None, 0, "ready"])

    async def probe() -> str | int | None:
        return next(values)

    assert await wait_for_async(probe, within=5, interval=0.01) == "ready"


def test_series_keeps_samples_with_equal_labels_apart() -> None:
    text = 'up{role="decode",endpoint="d-0"} 1\nup{role="decode",endpoint="d-0"} 0\nup{role="prefill",endpoint="p"} 1\n'
    decode = {"role": "decode", "endpoint": "d-0"}
    assert series(text, "up", role="decode") == [(decode, 1.0), (decode, 0.0)]


@pytest.fixture
async def counting_server() -> AsyncIterator[tuple[str, list[int]]]:
    """A real server on loopback whose `hits_total` counts the requests to /hit."""
    hits = [0]

    async def hit(_request: web.Request) -> web.Response:
        hits[0] += 1
        return web.Response(text="ok")

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(text=f"# TYPE hits counter\nhits_total {hits[0]}\n")

    app = web.Application()
    app.router.add_get("/hit", hit)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}", hits
    finally:
        await runner.cleanup()


async def test_wait_for_metric_returns_the_exposition_that_reached_the_count(
    counting_server: tuple[str, list[int]],
) -> None:
    url, hits = counting_server
    hits[0] = 2
    text = await wait_for_metric(url, "hits_total", 2, within=5)
    assert "hits_total 2\n" in text
    started = time.monotonic()
    with pytest.raises(WaitTimeoutError, match="hits_total >= 3"):
        await wait_for_metric(url, "hits_total", 3, within=0.3)
    assert time.monotonic() - started >= 0.3


async def test_probes_see_a_live_server_and_a_closed_port(counting_server: tuple[str, list[int]]) -> None:
    url, hits = counting_server
    port = int(url.rsplit(":", 1)[1])
    assert listening(port)
    # http_ok blocks: run it off the event loop that serves the request.
    assert await asyncio.to_thread(http_ok, url + "/hit")
    assert hits == [1]
    assert not await asyncio.to_thread(http_ok, url + "/missing")
    closed = free_port()
    assert not listening(closed)
    assert not http_ok(f"http://127.0.0.1:{closed}/hit")


def test_bool_comparisons_turns_filters_into_0_1_and_leaves_label_matchers_alone() -> None:
    expr = 'max(x{a!="b", c=~"d>e"}) > 0 and on (a) y{s="1"} == 1 or z >= bool 2 or w > on (a) v'
    assert bool_comparisons(expr) == (
        'max(x{a!="b", c=~"d>e"}) > bool 0 and on (a) y{s="1"} == bool 1 or z >= bool 2 or w > bool on (a) v'
    )


def test_free_ports_are_never_ones_the_kernel_hands_to_outgoing_connections() -> None:
    """Ports from bind(0) are also the source ports of outgoing connections, which took one before its server bound
    it; the chosen ones lie below the kernel's ephemeral range, distinct and free."""
    low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    for _ in range(50):
        ports = free_ports(8)
        assert len(set(ports)) == 8, ports
        assert all(port < low for port in ports), (ports, low, high)
        for port in ports:
            with socket.create_server(("127.0.0.1", port)):
                pass


def test_a_taken_port_is_not_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    # The other port is one found free, not the taken one's neighbour: a server of the suite's other lane may hold
    # that (it did once, and free_ports tried the two taken ports until the test's timeout).
    spare = free_port()
    with socket.create_server(("127.0.0.1", free_port())) as squatter:
        taken = squatter.getsockname()[1]
        monkeypatch.setattr(net, "_chosen_range", lambda: [taken, spare])
        assert free_ports(1) == [spare]


def test_when_every_chosen_port_is_taken_the_kernel_chooses(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.create_server(("127.0.0.1", free_port())) as squatter:
        taken = squatter.getsockname()[1]
        monkeypatch.setattr(net, "_chosen_range", lambda: [taken])
        (port,) = free_ports(1)
        assert port != taken and port > 0
