"""PD conformance over real sockets: a prefill simulator and a decode simulator driven exactly as a PD proxy
drives vLLM (KNOWLEDGE.md's 3-step flow), and the ways a KV pull fails."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from pdserve_dev.testing.metrics import metric_value, scrape, wait_for_metric
from pdserve_dev.testing.net import free_port
from pdserve_dev.testing.sim import sim_in_process, sim_process, sim_server_in_process
from pdserve_dev.testing.wait import wait_for_async
from pdserve_sim.presets import FAST
from pdserve_sim.tokenizer import tokenize

PROMPT = "The quick brown fox jumps over the lazy dog. " * 20
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
KTP_KEYS = {
    "do_remote_prefill",
    "do_remote_decode",
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "tp_size",
    "dcp_size",
    "pp_size",
    "remote_num_tokens",
    "remote_blocks_expiry_time",
    "transfer_mode",
    "remote_prefill_cached_tokens",
}

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


async def prefill_step(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """Step 1 and 2: send the client's body to prefill with max_tokens 1; return its kv_transfer_params."""
    prefill_body = dict(body, max_tokens=1, stream=False, kv_transfer_params=PREFILL_PARAMS)
    prefill_body.pop("stream_options", None)
    async with http.post(url + "/v1/completions", json=prefill_body) as resp:
        assert resp.status == 200, await resp.text()
        data = await resp.json()
    params = data["kv_transfer_params"]
    assert isinstance(params, dict)
    return params


async def read_sse(resp: aiohttp.ClientResponse) -> list[str]:
    """The data payloads of an SSE response."""
    raw = (await resp.read()).decode()
    assert raw.endswith("data: [DONE]\n\n")
    return [event[len("data: ") :] for event in raw.split("\n\n") if event]


async def test_three_step_flow_pulls_kv_instead_of_recomputing(http: aiohttp.ClientSession) -> None:
    async with (
        sim_process(role="prefill", fast=True, engine_id="prefill-0") as prefill,
        sim_process(role="decode", fast=True, engine_id="decode-0") as decode,
    ):
        body = {
            "model": "sim-model",
            "prompt": PROMPT,
            "max_tokens": 12,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        params = await prefill_step(http, prefill.url, body)
        n_prompt = len(tokenize(PROMPT))
        assert set(params) == KTP_KEYS
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert params["remote_engine_id"] == "prefill-0"
        assert params["remote_host"] == "127.0.0.1"
        assert params["remote_port"] == prefill.side_channel_port
        assert params["remote_num_tokens"] == n_prompt
        assert params["transfer_mode"] == "pull"
        assert isinstance(params["remote_block_ids"], list) and isinstance(params["remote_block_ids"][0], list)
        async with http.get(prefill.url + "/sim/state") as resp:
            assert (await resp.json())["held_kv"] == 1

        # Step 3: the original body plus the params, unchanged, to decode.
        async with http.post(decode.url + "/v1/completions", json=dict(body, kv_transfer_params=params)) as resp:
            assert resp.status == 200
            events = await read_sse(resp)
        chunks = [json.loads(e) for e in events[:-1]]
        text_chunks = [c for c in chunks if c["choices"]]
        assert len(text_chunks) == 12
        assert text_chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["usage"] == {
            "prompt_tokens": n_prompt,
            "total_tokens": n_prompt + 12,
            "completion_tokens": 12,
        }

        metrics = await scrape(decode.url)
        by_source = "vllm:prompt_tokens_by_source_total"
        assert metric_value(metrics, by_source, source="external_kv_transfer") == n_prompt
        assert metric_value(metrics, by_source, source="local_compute") == 0
        assert metric_value(metrics, "vllm:nixl_bytes_transferred_count") == 1
        assert metric_value(metrics, "vllm:nixl_bytes_transferred_sum") == 16 * n_prompt
        assert metric_value(metrics, "vllm:nixl_num_failed_transfers_total") == 0
        # The prefill engine freed the blocks once pulled.
        async with http.get(prefill.url + "/sim/state") as resp:
            state = await resp.json()
        assert state["held_kv"] == 0 and state["kv_cache_usage"] == 0.0
        prefill_metrics = await scrape(prefill.url)
        assert metric_value(prefill_metrics, by_source, source="local_compute") == n_prompt


async def test_decode_fails_with_500_when_prefill_was_killed(http: aiohttp.ClientSession) -> None:
    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 4}
    async with sim_in_process(role="decode", kv_transfer_timeout_s=0.6) as decode:
        async with sim_process(role="prefill", fast=True) as prefill:
            params = await prefill_step(http, prefill.url, body)
            prefill.kill()
            await prefill.process.wait()
        started = time.monotonic()
        async with http.post(decode.url + "/v1/completions", json=dict(body, kv_transfer_params=params)) as resp:
            assert resp.status == 500
            error = (await resp.json())["error"]
        assert time.monotonic() - started >= 0.5  # retried until the transfer timeout, like vLLM's ~5 s
        assert error["type"] == "InternalServerError" and error["code"] == 500
        assert "KV transfer failed" in error["message"]
        metrics = await scrape(decode.url)
        assert metric_value(metrics, "vllm:nixl_num_failed_transfers_total") == 1
        assert metric_value(metrics, "vllm:request_success_total", finished_reason="error") == 1


async def test_recompute_policy_prefills_locally_when_the_pull_fails(http: aiohttp.ClientSession) -> None:
    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 4}
    async with (
        sim_in_process(role="prefill") as prefill,
        sim_in_process(role="decode", kv_transfer_timeout_s=0.3, kv_load_failure_policy="recompute") as decode,
    ):
        params = await prefill_step(http, prefill.url, body)
        params = dict(params, remote_request_id="cmpl-unknown")
        async with http.post(decode.url + "/v1/completions", json=dict(body, kv_transfer_params=params)) as resp:
            assert resp.status == 200
            data = await resp.json()
        assert data["usage"]["completion_tokens"] == 4
        metrics = await scrape(decode.url)
        n_prompt = len(tokenize(PROMPT))
        assert metric_value(metrics, "vllm:prompt_tokens_by_source_total", source="local_compute") == n_prompt
        assert metric_value(metrics, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0
        assert metric_value(metrics, "vllm:nixl_num_failed_transfers_total") == 1


async def test_pull_fails_after_the_lease_expired(http: aiohttp.ClientSession) -> None:
    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 4}
    transfer_timeout = 10.0
    async with (
        sim_in_process(role="prefill", kv_lease_seconds=0.2) as prefill,
        sim_in_process(role="decode", kv_transfer_timeout_s=transfer_timeout) as decode,
    ):
        params = await prefill_step(http, prefill.url, body)
        # The prefill engine counts the expired lease: from then on the KV is gone.
        prefill_metrics = await wait_for_metric(prefill.url, "vllm:nixl_num_kv_expired_reqs_total", 1)
        assert metric_value(prefill_metrics, "vllm:nixl_num_kv_expired_reqs_total") == 1
        assert metric_value(prefill_metrics, "vllm:kv_cache_usage_perc") == 0
        started = time.monotonic()
        async with http.post(decode.url + "/v1/completions", json=dict(body, kv_transfer_params=params)) as resp:
            assert resp.status == 500
            error = (await resp.json())["error"]
        # A refusal from a live peer is final: decode answers at once instead of retrying until its transfer
        # timeout (half of it is seconds of margin for a loaded machine).
        assert time.monotonic() - started < transfer_timeout / 2
        assert "expired" in error["message"]


async def test_a_request_queued_at_decode_keeps_its_kv_leased_by_heartbeats(http: aiohttp.ClientSession) -> None:
    """vLLM's NixlConnector renews the prefill engine's lease while a PD request waits in decode's queue (a
    heartbeat every decode lease / 6 s; the prefill side extends the lease to 2/3 of its own from then): a queue
    longer than the lease loses no KV. Here decode's one sequence slot is busy for ~3 s while the prefill engine's
    lease is 1.2 s."""
    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 4}
    one_slow_slot = dataclasses.replace(FAST, step_overhead=0.05, max_num_seqs=1)
    async with (
        sim_in_process(role="prefill", kv_lease_seconds=1.2) as prefill,
        sim_in_process(role="decode", timing=one_slow_slot, fast=False, kv_lease_seconds=0.6) as decode,
    ):
        params = await prefill_step(http, prefill.url, body)
        busy = asyncio.ensure_future(
            http.post(decode.url + "/v1/completions", json={"model": "sim-model", "prompt": "busy", "max_tokens": 60})
        )
        await wait_for_metric(decode.url, "vllm:num_requests_running", 1)
        started = time.monotonic()
        async with http.post(decode.url + "/v1/completions", json=dict(body, kv_transfer_params=params)) as resp:
            assert resp.status == 200, await resp.text()
        assert time.monotonic() - started > 1.2  # it waited longer than the lease
        metrics = await scrape(prefill.url)
        assert metric_value(metrics, "vllm:nixl_num_kv_expired_reqs_total") == 0
        assert metric_value(metrics, "pdserve:sim_kv_lease_extensions_total") >= 2
        (await busy).release()


async def test_pull_fails_when_kv_compat_ids_differ(http: aiohttp.ClientSession) -> None:
    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 4}
    async with (
        sim_in_process(role="prefill", kv_compat_id="layout-a") as prefill,
        sim_in_process(role="decode", kv_compat_id="layout-b") as decode,
    ):
        params = await prefill_step(http, prefill.url, body)
        async with http.post(decode.url + "/v1/completions", json=dict(body, kv_transfer_params=params)) as resp:
            assert resp.status == 500
            error = (await resp.json())["error"]
        assert "kv_compat_mismatch" in error["message"]
        # Both engines of the mismatched pair count it (what the rollout tests read to prove it never happened).
        for engine in (prefill, decode):
            assert metric_value(await scrape(engine.url), "pdserve:sim_kv_compat_mismatch_total") == 1
        # The held KV is untouched by a refused pull: a compatible decode can still fetch it.
        async with sim_in_process(role="decode", kv_compat_id="layout-a") as good:
            url = good.url + "/v1/completions"
            async with http.post(url, json=dict(body, kv_transfer_params=params)) as resp:
                assert resp.status == 200
            assert metric_value(await scrape(good.url), "pdserve:sim_kv_compat_mismatch_total") == 0
        assert metric_value(await scrape(prefill.url), "pdserve:sim_kv_compat_mismatch_total") == 1


async def test_a_second_pull_of_the_same_kv_is_refused(http: aiohttp.ClientSession) -> None:
    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 2}
    async with sim_in_process(role="prefill") as prefill, sim_in_process(role="decode") as decode:
        params = await prefill_step(http, prefill.url, body)
        url = decode.url + "/v1/completions"
        async with http.post(url, json=dict(body, kv_transfer_params=params)) as resp:
            assert resp.status == 200
        async with http.post(url, json=dict(body, kv_transfer_params=params)) as resp:
            assert resp.status == 500
            assert "already_pulled" in (await resp.json())["error"]["message"]


COMPAT = "layout-a"


class SideChannelPeer:
    """A hand-driven decode side of the side channel: one connection, each protocol step on request."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def pull(self, params: dict[str, Any], *, read_payload: bool = True) -> dict[str, Any]:
        """Send a pull for `params`' KV; return the answer's header (and read the payload unless told not to)."""
        request = {
            "v": 1,
            "op": "pull",
            "kv_compat_id": COMPAT,
            "engine_id": "hand-driven",
            "tp_size": 1,
            "remote_engine_id": params["remote_engine_id"],
            "remote_request_id": params["remote_request_id"],
            "block_ids": params["remote_block_ids"][0],
        }
        await self.send(request)
        header: dict[str, Any] = json.loads(await self.reader.readline())
        if header["ok"] and read_payload:
            await self.reader.readexactly(header["bytes"])
        return header

    async def done(self, params: dict[str, Any]) -> None:
        await self.send({"op": "done", "remote_request_id": params["remote_request_id"]})

    async def send(self, message: dict[str, Any]) -> None:
        self.writer.write(json.dumps(message).encode() + b"\n")
        await self.writer.drain()


@contextlib.asynccontextmanager
async def side_channel_peer(port: int) -> AsyncIterator[SideChannelPeer]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield SideChannelPeer(reader, writer)
    finally:
        writer.close()


async def held_kv(http: aiohttp.ClientSession, url: str) -> int:
    async with http.get(url + "/sim/state") as resp:
        return int((await resp.json())["held_kv"])


async def test_a_pull_cut_off_midway_leaves_the_kv_for_the_next_reader(http: aiohttp.ClientSession) -> None:
    """vLLM's prefill frees KV on the reader's completion notification, never because a read started: a decode
    engine whose pull timed out or broke off must not make the KV unreadable for a retry on another engine."""
    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 2}
    async with (
        sim_in_process(role="prefill", kv_compat_id=COMPAT) as prefill,
        sim_in_process(role="decode", kv_compat_id=COMPAT) as decode,
    ):
        params = await prefill_step(http, prefill.url, body)
        # A reader that got the answer, then went away mid-transfer (its deadline passed, it was killed, ...).
        async with side_channel_peer(prefill.side_channel_port) as gone:
            assert (await gone.pull(params, read_payload=False))["ok"]
        # Another reads it all but never notifies: still held (until the lease, as vLLM).
        async with side_channel_peer(prefill.side_channel_port) as silent:
            assert (await silent.pull(params))["ok"]
        assert await held_kv(http, prefill.url) == 1
        async with http.post(decode.url + "/v1/completions", json=dict(body, kv_transfer_params=params)) as resp:
            assert resp.status == 200, await resp.text()
        decoded = await scrape(decode.url)
        assert metric_value(decoded, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") > 0
        assert metric_value(decoded, "vllm:nixl_num_failed_transfers_total") == 0
        # The completed read's notification freed the blocks: the KV is gone for any later reader.
        await wait_for_async(
            lambda: _no_held_kv(http, prefill.url), within=20, message="the prefill engine to free the pulled KV"
        )
        async with side_channel_peer(prefill.side_channel_port) as late:
            assert (await late.pull(params))["error"] == "already_pulled"


async def _no_held_kv(http: aiohttp.ClientSession, url: str) -> bool:
    return await held_kv(http, url) == 0


async def test_only_the_reader_of_the_kv_can_free_it(http: aiohttp.ClientSession) -> None:
    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 2}
    async with sim_in_process(role="prefill", kv_compat_id=COMPAT) as prefill:
        params = await prefill_step(http, prefill.url, body)
        async with (
            side_channel_peer(prefill.side_channel_port) as reader,
            side_channel_peer(prefill.side_channel_port) as stranger,
        ):
            assert (await reader.pull(params))["ok"]
            # A notification on a connection that was not sent this KV frees nothing. The pull behind it on the
            # same connection is answered only after the server handled the notification: a counted order.
            await stranger.done(params)
            assert (await stranger.pull(params))["ok"]
            assert await held_kv(http, prefill.url) == 1
            await reader.done(params)
            assert (await reader.pull(params))["error"] == "already_pulled"
            assert await held_kv(http, prefill.url) == 0


async def test_chat_requests_follow_the_same_flow(http: aiohttp.ClientSession) -> None:
    body = {"model": "sim-model", "messages": [{"role": "user", "content": PROMPT}], "max_completion_tokens": 5}
    async with sim_in_process(role="prefill") as prefill, sim_in_process(role="decode") as decode:
        prefill_body = dict(
            body, max_tokens=1, max_completion_tokens=1, stream=False, kv_transfer_params=PREFILL_PARAMS
        )
        async with http.post(prefill.url + "/v1/chat/completions", json=prefill_body) as resp:
            assert resp.status == 200
            params = (await resp.json())["kv_transfer_params"]
        async with http.post(decode.url + "/v1/chat/completions", json=dict(body, kv_transfer_params=params)) as resp:
            assert resp.status == 200
            data = await resp.json()
        assert data["usage"]["completion_tokens"] == 5
        assert data["kv_transfer_params"] is None
        metrics = await scrape(decode.url)
        assert metric_value(metrics, "vllm:prompt_tokens_by_source_total", source="local_compute") == 0


async def test_prefill_tp_larger_than_decode_tp_is_refused(http: aiohttp.ClientSession) -> None:
    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 2}
    async with (
        sim_in_process(role="prefill", tensor_parallel_size=2) as prefill,
        sim_in_process(role="decode", tensor_parallel_size=1) as small,
        sim_in_process(role="decode", tensor_parallel_size=4) as large,
    ):
        params = await prefill_step(http, prefill.url, body)
        assert params["tp_size"] == 2
        async with http.post(small.url + "/v1/completions", json=dict(body, kv_transfer_params=params)) as resp:
            assert resp.status == 500
            assert "tp_unsupported" in (await resp.json())["error"]["message"]
        # Prefill TP < decode TP is fine (vLLM supports that heterogeneous layout).
        async with http.post(large.url + "/v1/completions", json=dict(body, kv_transfer_params=params)) as resp:
            assert resp.status == 200


async def test_first_pull_from_a_new_peer_pays_the_handshake_once(http: aiohttp.ClientSession) -> None:
    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 2}
    handshake = 1.0  # long next to a pull on loopback, so a loaded machine cannot blur the two
    async with (
        sim_in_process(role="prefill") as prefill,
        sim_in_process(role="decode", kv_handshake_s=handshake) as decode,
    ):
        times = []
        for _ in range(2):
            params = await prefill_step(http, prefill.url, body)
            started = time.monotonic()
            async with http.post(decode.url + "/v1/completions", json=dict(body, kv_transfer_params=params)) as resp:
                assert resp.status == 200
            times.append(time.monotonic() - started)
        # The first request pays at least the modelled handshake; the second, less than one handshake.
        assert times[0] >= handshake > times[1]


async def test_a_reused_request_id_does_not_leak_held_kv(http: aiohttp.ClientSession) -> None:
    body = dict(model="sim-model", prompt=PROMPT, max_tokens=1, kv_transfer_params=PREFILL_PARAMS)
    async with sim_server_in_process(role="prefill") as prefill:
        url = f"http://127.0.0.1:{prefill.http_port}/v1/completions"
        for _ in range(3):
            async with http.post(url, json=body, headers={"X-Request-Id": "same"}) as resp:
                assert (await resp.json())["kv_transfer_params"]["remote_request_id"] == "cmpl-same"
        state = prefill.engine.snapshot()
        assert state["held_kv"] == 1
        n_blocks = prefill.engine.pool.blocks_for(len(tokenize(PROMPT)) + 1)
        assert state["num_blocks"] - state["free_blocks"] == n_blocks


async def test_a_decode_body_that_differs_from_the_prefill_body_is_flagged(http: aiohttp.ClientSession) -> None:
    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 2}
    async with sim_in_process(role="prefill") as prefill, sim_in_process(role="decode") as decode:
        params = await prefill_step(http, prefill.url, body)
        changed = dict(body, prompt=PROMPT + " and more", kv_transfer_params=params)
        async with http.post(decode.url + "/v1/completions", json=changed) as resp:
            assert resp.status == 200
        assert metric_value(await scrape(decode.url), "pdserve:sim_kv_prompt_mismatch_total") == 1


async def test_decode_reuses_side_channel_connections(http: aiohttp.ClientSession) -> None:
    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 2}
    async with sim_in_process(role="prefill") as prefill, sim_in_process(role="decode") as decode:
        for _ in range(5):
            params = await prefill_step(http, prefill.url, body)
            async with http.post(decode.url + "/v1/completions", json=dict(body, kv_transfer_params=params)) as resp:
                assert resp.status == 200
        async with http.get(prefill.url + "/sim/state") as resp:
            assert (await resp.json())["side_channel_connections"] == 1


async def test_a_restarted_prefill_engine_is_reached_on_a_fresh_connection(http: aiohttp.ClientSession) -> None:
    side_port = free_port()
    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 2}
    transfer_timeout = 10.0
    async with sim_in_process(role="decode", kv_transfer_timeout_s=transfer_timeout) as decode:
        for _ in range(2):
            async with sim_process(role="prefill", fast=True, side_channel_port=side_port) as prefill:
                params = await prefill_step(http, prefill.url, body)
                started = time.monotonic()
                url = decode.url + "/v1/completions"
                async with http.post(url, json=dict(body, kv_transfer_params=params)) as resp:
                    assert resp.status == 200
                # The second round's pooled connection points at the dead first process: decode opens a fresh
                # one instead of retrying until its transfer timeout (half of it leaves seconds of margin).
                assert time.monotonic() - started < transfer_timeout / 2


async def test_side_channel_survives_garbage(http: aiohttp.ClientSession) -> None:
    async with sim_in_process(role="prefill") as prefill:
        for garbage in (b"not json\n", b"[1]\n", b"x" * (2 << 20) + b"\n", b"\n"):
            reader, writer = await asyncio.open_connection("127.0.0.1", prefill.side_channel_port)
            try:
                writer.write(garbage)
                await writer.drain()
                answer = await asyncio.wait_for(reader.read(), 5)
            except ConnectionResetError:
                answer = b""  # the server refused and closed while the oversized line was still arriving
            finally:
                writer.close()
            assert answer == b"" or json.loads(answer)["error"] == "bad_request"
        body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS}
        async with http.post(prefill.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200


async def _draining(http: aiohttp.ClientSession, url: str) -> bool:
    async with http.get(url + "/health") as resp:
        return resp.status == 503


async def test_a_draining_prefill_engine_serves_the_kv_it_handed_out_then_exits(http: aiohttp.ClientSession) -> None:
    """vLLM under --shutdown-timeout keeps stepping until the KV of finished prefills is read: SIGTERM must not
    strand KV a decode engine is about to pull (scale-down of the prefill pool)."""
    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 4}
    async with (
        sim_in_process(role="decode", kv_transfer_timeout_s=0.5) as decode,
        sim_process(role="prefill", fast=True, shutdown_timeout=60, kv_lease_seconds=60) as prefill,
    ):
        params = await prefill_step(http, prefill.url, body)
        prefill.process.send_signal(signal.SIGTERM)
        await wait_for_async(lambda: _draining(http, prefill.url), within=10, message="the prefill engine draining")
        # Draining: nothing new is accepted (vLLM's 503 on every path but /live and /metrics)...
        async with http.post(prefill.url + "/v1/completions", json=body) as refused:
            assert refused.status == 503
        async with http.get(prefill.url + "/v1/models") as refused:
            assert refused.status == 503
        async with http.get(prefill.url + "/metrics") as metrics:
            assert metrics.status == 200
        # ...but the side channel still serves the KV it handed out before the signal.
        async with http.post(decode.url + "/v1/completions", json=dict(body, kv_transfer_params=params)) as resp:
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["usage"]["completion_tokens"] == 4
        decoded = await scrape(decode.url)
        assert metric_value(decoded, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") > 0
        # Nothing is left to serve: the engine exits cleanly long before its 60 s shutdown timeout.
        assert await asyncio.wait_for(prefill.process.wait(), 20) == 0


async def test_a_draining_prefill_engine_stops_once_the_lease_of_unpulled_kv_expired(
    http: aiohttp.ClientSession,
) -> None:
    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 4}
    async with sim_process(role="prefill", fast=True, shutdown_timeout=60, kv_lease_seconds=1) as prefill:
        await prefill_step(http, prefill.url, body)
        prefill.process.send_signal(signal.SIGTERM)
        # Nobody pulls: the drain ends with the lease (1 s), not with the 60 s shutdown timeout.
        assert await asyncio.wait_for(prefill.process.wait(), 20) == 0
