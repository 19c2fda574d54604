"""The load helper and the TCP forwarder the autoscaler's end-to-end test and benchmark rely on: prompts of exactly
the asked size sharing no block, what clients saw counted right (answers, failures, hang-ups), and a forwarder
that refuses while cut and forwards again once restored."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from pdserve.api.prompt import count_tokens, text_tokens, utf8
from pdserve_dev.testing.load import Load, prompt_of
from pdserve_dev.testing.net import TcpForwarder, http_ok
from pdserve_dev.testing.sim import set_faults, sim_in_process

pytestmark = pytest.mark.timeout(60)


def test_prompts_have_the_asked_tokens_and_share_no_block() -> None:
    first, second = prompt_of(4000, 1), prompt_of(4000, 2)
    assert count_tokens(utf8(first)) == count_tokens(utf8(second)) == 4000
    blocks = 16  # the engines' KV block: no 16-token block of one prompt appears in the other
    a, b = text_tokens(first), text_tokens(second)
    chunks = {tuple(a[i : i + blocks]) for i in range(0, len(a), blocks)}
    assert not any(tuple(b[i : i + blocks]) in chunks for i in range(0, len(b), blocks))
    assert prompt_of(10, 7) == prompt_of(10, 7)


async def test_load_counts_answers_failures_and_hang_ups() -> None:
    async with sim_in_process() as sim, Load(sim.url, "sim-model") as load:
        streamed = load.send(64, 8, stream=True)
        whole = load.send(64, 8, stream=False)
        await asyncio.gather(streamed, whole)
        assert load.stats.ok == 2 and load.stats.failed == 0
        assert all(a.output_tokens == 8 and 0 <= a.ttft_s <= a.seconds for a in load.stats.answers)
        await set_faults(sim.url, fail_next=1)
        await load.send(64, 8)
        assert load.stats.failed == 1 and "HTTP 503" in load.stats.failures[0]
        assert load.stats.statuses == {503: 1}
        load.streams(3, 32, (100_000, 100_000))  # never finish: stopped below
        await asyncio.sleep(0.2)
        await load.stop_streams()
        assert load.stats.cancelled == 3 and load.stats.failed == 1
        assert load.stats.sent == 6


def test_forwarder_refuses_while_cut_and_forwards_once_restored() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def serve() -> None:
            while True:
                try:
                    conn, _ = server.accept()
                except OSError:
                    return
                with conn:
                    conn.recv(4096)
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")

        threading.Thread(target=serve, daemon=True).start()
        forwarder = TcpForwarder(("127.0.0.1", port)).open()
        try:
            assert http_ok(forwarder.url)
            forwarder.close()
            assert not http_ok(forwarder.url)
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", forwarder.port), timeout=2).close()
            forwarder.open()
            assert http_ok(forwarder.url)
        finally:
            forwarder.close()
