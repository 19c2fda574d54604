"""Prompt plus output budget beyond the served context is refused before prefill works on it (issue 18.8: 20
requests with `max_tokens: 1e9` got their 400 from decode after prefill had computed them, and the prefill engine
held their KV until the lease expired)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
import pytest

from pdserve.api.router_config import RouterConfig
from pdserve_dev.testing.sim import requests_seen, sim_in_process
from pdserve_dev.testing.wait import wait_for_async
from pdserve_runtime.router import context
from pdserve_runtime.router.app import RouterApp
from pdserve_runtime.router.engine_models import model_context_length
from pdserve_sim.config import SimConfig
from pdserve_sim.presets import FAST

pytestmark = pytest.mark.timeout(60)

CONTEXT = 2048
SMALL = SimConfig(timing=dataclasses.replace(FAST, max_model_len=CONTEXT), fast=True)
WORDS = "river valley farm stone bridge market harvest winter"


def prompt(words: int) -> str:
    pool = WORDS.split()
    return " ".join(pool[i % len(pool)] for i in range(words))


async def post(url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], str]:
    async with aiohttp.ClientSession() as session, session.post(url + path, json=body) as response:
        return response.status, orjson.loads(await response.read()), response.headers.get("X-Pdserve-Route", "")


async def known(router: RouterApp) -> None:
    """Wait until the router has read the decode engine's context length (a background read)."""

    async def read() -> bool:
        await asyncio.sleep(0)
        return all(state.max_model_len == CONTEXT for state in router.table.states("decode"))

    await wait_for_async(read, within=10, message="the decode engine's context length read")


@pytest.mark.parametrize(
    ("path", "body", "counted"),
    [
        # Certain without counting: the output alone is the whole context.
        ("/v1/completions", {"prompt": prompt(50), "max_tokens": 10**9}, False),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4096},
            False,
        ),
        # Token ids: counted exactly.
        ("/v1/completions", {"prompt": list(range(1500)), "max_tokens": 1000}, False),
        # Text that may or may not fit: counted by the prefill engine's /tokenize.
        ("/v1/completions", {"prompt": prompt(1500), "max_tokens": 1000}, True),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt(1500)}], "max_tokens": 1000}, True),
    ],
    ids=["max-tokens-alone", "chat-max-completion-tokens", "token-ids", "text-counted", "chat-counted"],
)
async def test_a_request_that_cannot_fit_is_refused_before_prefill(
    router_server: Any, make_config: Callable[..., RouterConfig], path: str, body: dict[str, Any], counted: bool
) -> None:
    async with sim_in_process(SMALL, role="prefill") as p, sim_in_process(SMALL, role="decode") as d:
        config = make_config([p.url], [d.url], disaggregation_threshold_tokens=0)
        async with router_server(config) as (url, router):
            await known(router)
            status, answer, _ = await post(url, path, {"model": "sim-model", **body})
        assert status == 400, answer
        error = answer["error"]
        assert error["type"] == "BadRequestError"
        assert error["param"] == ("max_completion_tokens" if "max_completion_tokens" in body else "max_tokens")
        assert error["message"].startswith("'max_tokens' or 'max_completion_tokens' is too large")
        assert f"maximum context length is {CONTEXT} tokens" in error["message"]
        assert ("input tokens" in error["message"]) == (counted or isinstance(body.get("prompt"), list))
        assert await requests_seen(p.url) == 0  # the prefill engine never worked on it
        assert await requests_seen(d.url) == 0


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": prompt(400), "max_tokens": 1000}),  # counted: fits
        ("/v1/completions", {"prompt": prompt(20), "max_tokens": 100}),  # fits even at one token per byte
        ("/v1/completions", {"prompt": prompt(1500), "max_tokens": None}),  # the rest of the context
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt(400)}], "max_tokens": 1000}),
    ],
    ids=["counted", "certain", "rest-of-context", "chat-counted"],
)
async def test_a_request_that_fits_goes_through_prefill_as_before(
    router_server: Any, make_config: Callable[..., RouterConfig], path: str, body: dict[str, Any]
) -> None:
    async with sim_in_process(SMALL, role="prefill") as p, sim_in_process(SMALL, role="decode") as d:
        config = make_config([p.url], [d.url], disaggregation_threshold_tokens=0)
        async with router_server(config) as (url, router):
            await known(router)
            status, answer, route = await post(url, path, {"model": "sim-model", **body, "ignore_eos": False})
        assert (status, route) == (200, "pd"), answer
        assert await requests_seen(p.url) == 1


async def test_without_a_known_context_length_the_engines_decide_as_before(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    async with sim_in_process(SMALL, role="prefill") as p, sim_in_process(SMALL, role="decode") as d:
        config = make_config([p.url], [d.url], disaggregation_threshold_tokens=0)
        async with router_server(config) as (url, router):
            await router.context_lengths.stop()  # nothing learnt, whatever it had read
            for state in router.table.states("decode"):
                state.max_model_len = None
            status, answer, _ = await post(url, "/v1/completions", {"model": "sim-model", "prompt": "hi",
                                                                   "max_tokens": 10**9})  # fmt: skip
        assert status == 400 and "maximum context length" in answer["error"]["message"]  # the decode engine's 400
        assert await requests_seen(p.url) == 1  # as before: prefill worked first


# -- the pure parts ------------------------------------------------------------------------------------------


def test_the_context_length_is_read_from_the_served_models_entry() -> None:
    answer = orjson.dumps({"object": "list", "data": [
        {"id": "base", "object": "model", "max_model_len": 8192, "root": "/models/base", "parent": None},
        {"id": "adapter", "object": "model", "root": "/adapters/a", "parent": "base"},
    ]})  # fmt: skip
    assert model_context_length(answer, "base") == 8192
    assert model_context_length(answer, "") == 8192
    assert model_context_length(answer, "adapter") is None
    assert model_context_length(b"not json", "base") is None
    assert model_context_length(b'{"data": [{"id": "base", "max_model_len": true}]}', "base") is None


@pytest.mark.parametrize(
    ("payload", "chat", "expected"),
    [
        ({"prompt": "x", "max_tokens": 4096}, False, context.Verdict.REFUSE),
        ({"prompt": "x"}, False, context.Verdict.FITS),  # vLLM's default of 16
        ({"prompt": "x" * 4090}, False, context.Verdict.ASK),  # 16 more may not fit: count
        ({"prompt": "x", "max_tokens": None}, False, context.Verdict.FITS),
        ({"prompt": [1] * 4000, "max_tokens": 96}, False, context.Verdict.FITS),
        ({"prompt": [1] * 4000, "max_tokens": 97}, False, context.Verdict.REFUSE),
        ({"prompt": [[1] * 10, [1] * 4090], "max_tokens": 7}, False, context.Verdict.REFUSE),
        ({"prompt": ["a", "b" * 5000], "max_tokens": 10}, False, context.Verdict.FITS),  # a batch: left to engines
        ({"messages": [{"role": "user", "content": "hi"}]}, True, context.Verdict.FITS),  # the rest of the context
        (
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000, "max_completion_tokens": 10},
            True,
            context.Verdict.FITS,
        ),  # max_completion_tokens wins, as in vLLM
        (
            {
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                "max_tokens": 4000,
            },
            True,
            context.Verdict.FITS,
        ),  # not text only: left to the engines
    ],
)
def test_verdicts(payload: dict[str, Any], chat: bool, expected: context.Verdict) -> None:
    assert context.verdict(context.budget(payload, chat, len(orjson.dumps(payload))), 4096) is expected


def test_what_tokenize_is_asked() -> None:
    payload = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}],
               "chat_template_kwargs": {"enable_thinking": False}, "temperature": 0.5, "max_tokens": 9}  # fmt: skip
    need = context.budget(payload, True, 100)
    assert need.tokenize == {"model": "m", "messages": payload["messages"], "tools": payload["tools"],
                             "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    assert context.budget({**payload, "tool_choice": "none"}, True, 100).tokenize is not None
    assert "tools" not in (context.budget({**payload, "tool_choice": "none"}, True, 100).tokenize or {})
