"""The OpenAI API as vLLM serves it: response shapes, the SSE stream format, errors, small endpoints."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from pdserve_dev.testing.metrics import metric_value, scrape, wait_for_metric
from pdserve_dev.testing.sim import sim_server_in_process
from pdserve_sim.server import SimServer
from pdserve_sim.tokenizer import flatten_chat, tokenize

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def sim() -> AsyncIterator[SimServer]:
    async with sim_server_in_process(served_model_names=("sim-model", "alias")) as server:
        yield server


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        yield session


def url(sim: SimServer, path: str) -> str:
    return f"http://127.0.0.1:{sim.http_port}{path}"


async def sse_events(resp: aiohttp.ClientResponse) -> list[str]:
    raw = (await resp.read()).decode()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events[:-1])
    return [e[len("data: ") :] for e in events[:-2]]


async def test_completion_response_shape_and_usage(sim: SimServer, http: aiohttp.ClientSession) -> None:
    prompt = "Tell me about prefill and decode."
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 7}
    async with http.post(url(sim, "/v1/completions"), json=body) as resp:
        assert resp.status == 200
        data = await resp.json()
    assert data["id"].startswith("cmpl-")
    assert data["object"] == "text_completion"
    assert data["model"] == "sim-model"
    (choice,) = data["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["logprobs"] is None
    n_prompt = len(tokenize(prompt))
    assert data["usage"]["prompt_tokens"] == n_prompt
    assert data["usage"]["completion_tokens"] == 7
    assert data["usage"]["total_tokens"] == n_prompt + 7
    # Every generated token is one word; re-tokenizing the output gives the count back.
    assert len(tokenize(choice["text"])) == 7
    assert data["kv_transfer_params"] is None
    # Deterministic: the same prompt gives the same text (on any engine).
    async with http.post(url(sim, "/v1/completions"), json=body) as resp:
        assert (await resp.json())["choices"][0]["text"] == choice["text"]


async def test_completions_default_to_16_tokens_and_accept_token_ids(
    sim: SimServer, http: aiohttp.ClientSession
) -> None:
    async with http.post(url(sim, "/v1/completions"), json={"prompt": [101, 102, 103]}) as resp:
        data = await resp.json()
    assert data["usage"] == {
        "prompt_tokens": 3,
        "total_tokens": 19,
        "completion_tokens": 16,
        "prompt_tokens_details": None,
    }


async def test_completion_stream_format(sim: SimServer, http: aiohttp.ClientSession) -> None:
    body = {"model": "alias", "prompt": "a b c d", "max_tokens": 5, "stream": True}
    async with http.post(url(sim, "/v1/completions"), json=body) as resp:
        assert resp.status == 200
        events = await sse_events(resp)
    chunks = [json.loads(e) for e in events]
    assert len(chunks) == 5  # one event per token, no usage event unless asked for
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and next(iter(ids)).startswith("cmpl-")
    for c in chunks:
        assert list(c) == ["id", "object", "created", "model", "choices"]
        assert c["object"] == "text_completion" and c["model"] == "alias"
        (choice,) = c["choices"]
        assert list(choice) == ["index", "text", "logprobs", "finish_reason", "stop_reason"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    async with http.post(url(sim, "/v1/completions"), json=dict(body, stream=False)) as resp:
        assert (await resp.json())["choices"][0]["text"] == text


async def test_stream_usage_chunk_when_requested(sim: SimServer, http: aiohttp.ClientSession) -> None:
    body = {"prompt": "x y", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    async with http.post(url(sim, "/v1/completions"), json=body) as resp:
        chunks = [json.loads(e) for e in await sse_events(resp)]
    assert "usage" not in chunks[0]
    last = chunks[-1]
    assert last["choices"] == []
    assert last["usage"] == {"prompt_tokens": 2, "total_tokens": 5, "completion_tokens": 3}


async def test_continuous_usage_stats(sim: SimServer, http: aiohttp.ClientSession) -> None:
    body = {
        "prompt": "x y",
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    async with http.post(url(sim, "/v1/completions"), json=body) as resp:
        chunks = [json.loads(e) for e in await sse_events(resp)]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3, 3]


async def test_chat_stream_format(sim: SimServer, http: aiohttp.ClientSession) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    body = {"model": "sim-model", "messages": messages, "max_completion_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    async with http.post(url(sim, "/v1/chat/completions"), json=body) as resp:
        chunks = [json.loads(e) for e in await sse_events(resp)]
    assert all(c["object"] == "chat.completion.chunk" and c["id"].startswith("chatcmpl-") for c in chunks)
    first = chunks[0]["choices"][0]
    assert first == {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    token_chunks = chunks[1:-1]
    assert len(token_chunks) == 4
    assert all(list(c["choices"][0]["delta"]) == ["content"] for c in token_chunks)
    assert token_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert token_chunks[-1]["choices"][0]["stop_reason"] is None
    n_prompt = len(tokenize(flatten_chat([("system", "Be brief."), ("user", "Hi there")])))
    assert chunks[-1]["usage"] == {"prompt_tokens": n_prompt, "total_tokens": n_prompt + 4, "completion_tokens": 4}


async def test_chat_completion_response(sim: SimServer, http: aiohttp.ClientSession) -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "max_tokens": 3}
    async with http.post(url(sim, "/v1/chat/completions"), json=body) as resp:
        data = await resp.json()
    assert data["object"] == "chat.completion"
    message = data["choices"][0]["message"]
    assert message["role"] == "assistant" and len(tokenize(message["content"])) == 3
    assert data["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    "case",
    [
        ("/v1/completions", {"prompt": "x", "model": "nope"}, 404, "model"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n"),
        ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt"),
        ("/v1/completions", {}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "kv_transfer_params": {"do_remote_prefill": True}}, 400, None),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ],
)
async def test_invalid_requests_get_vllm_error_bodies(
    sim: SimServer, http: aiohttp.ClientSession, case: tuple[str, dict[str, Any], int, str | None]
) -> None:
    path, body, status, param = case
    async with http.post(url(sim, path), json=body) as resp:
        assert resp.status == status
        error = (await resp.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
    assert error["param"] == param
    assert error["message"]


async def test_malformed_json_is_a_400(sim: SimServer, http: aiohttp.ClientSession) -> None:
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe", b""):
        async with http.post(url(sim, "/v1/completions"), data=raw) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["type"] == "BadRequestError"


async def test_small_endpoints(sim: SimServer, http: aiohttp.ClientSession) -> None:
    async with http.get(url(sim, "/health")) as resp:
        assert resp.status == 200
    async with http.get(url(sim, "/v1/models")) as resp:
        models = await resp.json()
    assert [m["id"] for m in models["data"]] == ["sim-model", "alias"]
    # vLLM's ModelCard, field for field (a router reads max_model_len from it).
    card = models["data"][0]
    assert set(card) == {"id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission"}
    assert (card["object"], card["owned_by"], card["parent"]) == ("model", "vllm", None)
    assert card["max_model_len"] == sim.config.timing.max_model_len
    [permission] = card["permission"]
    assert permission["object"] == "model_permission" and permission["id"].startswith("modelperm-")
    assert {key: permission[key] for key in ("allow_sampling", "allow_logprobs", "allow_view", "organization")} == {
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_view": True,
        "organization": "*",
    }
    async with http.get(url(sim, "/version")) as resp:
        assert "version" in await resp.json()
    text = await scrape(url(sim, ""))
    for name in (
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total",
        "vllm:nixl_xfer_time_seconds",
    ):
        assert name in text
    assert 'engine="0"' in text and 'model_name="sim-model"' in text


async def test_metrics_count_requests_and_tokens(sim: SimServer, http: aiohttp.ClientSession) -> None:
    for _ in range(3):
        async with http.post(url(sim, "/v1/completions"), json={"prompt": "one two three", "max_tokens": 4}) as resp:
            assert resp.status == 200
    text = await scrape(url(sim, ""))
    assert metric_value(text, "vllm:request_success_total", finished_reason="length") == 3
    assert metric_value(text, "vllm:generation_tokens_total") == 12
    assert metric_value(text, "vllm:prompt_tokens_total") == 9
    assert metric_value(text, "vllm:time_to_first_token_seconds_count") == 3
    assert metric_value(text, "vllm:inter_token_latency_seconds_count") == 9
    assert metric_value(text, "vllm:e2e_request_latency_seconds_count") == 3


async def test_client_disconnect_cancels_the_request(http: aiohttp.ClientSession) -> None:
    from pdserve_sim.presets import CPU_TINY

    async with sim_server_in_process(timing=CPU_TINY, fast=False, speed=1.0) as sim:
        body = {"prompt": "a b c", "max_tokens": 1000, "stream": True}
        async with http.post(url(sim, "/v1/completions"), json=body) as resp:
            await resp.content.readuntil(b"\n\n")
            assert sim.engine.snapshot()["running"] == 1
        # The engine counts the abort once the server notices the client is gone; then nothing is held.
        await wait_for_metric(url(sim, ""), "vllm:request_success_total", 1, finished_reason="abort")
        state = sim.engine.snapshot()
        assert state["running"] == 0 and state["kv_cache_usage"] == 0.0


async def test_abort_endpoint(http: aiohttp.ClientSession) -> None:
    from pdserve_sim.presets import CPU_TINY

    async with sim_server_in_process(timing=CPU_TINY, fast=False) as sim:
        body = {"prompt": "a b c", "max_tokens": 1000, "stream": True}
        headers = {"X-Request-Id": "abc"}
        async with http.post(url(sim, "/v1/completions"), json=body, headers=headers) as resp:
            await resp.content.readuntil(b"\n\n")
            async with http.post(url(sim, "/abort"), json={"request_id": "cmpl-abc"}) as aborted:
                assert aborted.status == 200
            raw = (await resp.read()).decode()
        assert raw.endswith('"finish_reason":"abort","stop_reason":null}]}\n\ndata: [DONE]\n\n')
        async with http.post(url(sim, "/abort"), json={"request_id": "cmpl-abc"}) as again:
            assert again.status == 404


async def test_tokenize_endpoint(sim: SimServer, http: aiohttp.ClientSession) -> None:
    async with http.post(url(sim, "/tokenize"), json={"model": "sim-model", "prompt": "Hello, world"}) as resp:
        data = await resp.json()
    assert data["tokens"] == tokenize("Hello, world") and data["count"] == 3
    messages = [{"role": "user", "content": "Hi"}]
    async with http.post(url(sim, "/tokenize"), json={"messages": messages}) as resp:
        assert (await resp.json())["count"] == len(tokenize(flatten_chat([("user", "Hi")])))
    async with http.post(url(sim, "/tokenize"), json={"prompt": 5}) as resp:
        assert resp.status == 400


async def test_natural_eos_respects_ignore_eos_and_min_tokens(http: aiohttp.ClientSession) -> None:
    async with sim_server_in_process(eos_mean_tokens=4) as sim:
        lengths = []
        for i in range(5):
            body = {"prompt": f"prompt number {i}", "max_tokens": 500}
            async with http.post(url(sim, "/v1/completions"), json=body) as resp:
                data = await resp.json()
            assert data["choices"][0]["finish_reason"] == "stop"
            lengths.append(data["usage"]["completion_tokens"])
        assert max(lengths) < 100
        async with http.post(url(sim, "/v1/completions"), json=dict(body, ignore_eos=True)) as resp:
            data = await resp.json()
        assert data["choices"][0]["finish_reason"] == "length" and data["usage"]["completion_tokens"] == 500
        async with http.post(url(sim, "/v1/completions"), json=dict(body, min_tokens=200, stream=True)) as resp:
            raw = (await resp.read()).decode()
        assert raw.count('"text"') == 200 and '"finish_reason":"stop"' in raw


async def test_prompt_tokens_details_and_request_id_headers(http: aiohttp.ClientSession) -> None:
    async with sim_server_in_process(prompt_tokens_details=True, request_id_headers=True) as sim:
        prompt = [100 + i for i in range(40)]
        for expected_cached in (0, 32):  # the second time, two full blocks of 16 come from the prefix cache
            body = {"prompt": prompt, "max_tokens": 2}
            async with http.post(url(sim, "/v1/completions"), json=body, headers={"X-Request-Id": "r1"}) as resp:
                assert resp.headers["X-Request-Id"] == "r1"
                data = await resp.json()
            assert data["usage"]["prompt_tokens_details"] == {"cached_tokens": expected_cached}
        stream = {"prompt": prompt, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
        async with http.post(url(sim, "/v1/completions"), json=stream) as resp:
            assert len(resp.headers["X-Request-Id"]) == 32
            chunks = [json.loads(e) for e in await sse_events(resp)]
        assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
