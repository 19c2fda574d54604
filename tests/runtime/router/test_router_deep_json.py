"""Bodies the router can parse but could not re-encode: orjson reads JSON nested up to 1024 levels but writes at
most 254, and the router re-encodes the body whenever it changes it (PD bodies, stripped internal fields).

Before the fix such a body was a text/plain 500, and on the decode-only path it also leaked the decode engine's
in-flight count for good (the encode ran after the counter was taken), skewing every later routing decision.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
import pytest

from pdserve.api.router_config import RouterConfig
from pdserve_dev.testing.sim import sim_in_process
from pdserve_runtime.router.messages import parse_body

pytestmark = pytest.mark.timeout(60)

LONG = "The history of the river valley settlements began with small farms. " * 30  # ~ 360 tokens
SHORT = "Say hi."


def deep(levels: int) -> Any:
    value: Any = []
    for _ in range(levels - 1):
        value = [value]
    return value


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"prompt": LONG, "max_tokens": 2, "logit_bias": deep(300)}, id="pd"),
        pytest.param(
            {"prompt": SHORT, "max_tokens": 2, "logit_bias": deep(300), "kv_transfer_params": {"x": 1}},
            id="decode-only-stripped",
        ),
        pytest.param({"prompt": SHORT, "max_tokens": 2, "logit_bias": deep(300)}, id="decode-only"),
    ],
)
async def test_a_body_nested_too_deep_to_forward_is_a_400_and_releases_nothing(
    router_server: Any, make_config: Callable[..., RouterConfig], body: dict[str, Any]
) -> None:
    raw = _encode_deep({"model": "sim-model", **body})
    async with (
        sim_in_process(role="prefill") as p,
        sim_in_process(role="decode") as d,
        router_server(make_config([p.url], [d.url])) as (url, router),
        aiohttp.ClientSession() as session,
    ):
        headers = {"Content-Type": "application/json"}
        async with session.post(url + "/v1/completions", data=raw, headers=headers) as response:
            status, text = response.status, await response.text()
        # Before the fix: 500 everywhere, and the stripped decode-only case left the decode engine at in_flight 1.
        leaked = [state.in_flight for role in ("prefill", "decode") for state in router.table.states(role)]
    assert (status, leaked) == (400, [0, 0]), text
    error = orjson.loads(text)["error"]
    assert error["type"] == "BadRequestError"
    assert "nest" in error["message"]


def _encode_deep(body: dict[str, Any]) -> bytes:
    """JSON text of `body` (orjson cannot write it, which is the point; the stdlib can)."""
    return json.dumps(body).encode()


def test_parse_body_rejects_what_it_could_not_forward() -> None:
    with pytest.raises(ValueError, match="nest"):
        parse_body(_encode_deep({"a": deep(300)}))
    assert parse_body(_encode_deep({"a": deep(200)}))["a"]
