"""Property tests: whatever JSON a client sends, request analysis never raises (the router answers 4xx or
forwards, never 500s on its own parsing)."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve_runtime.router.messages import ENGINE_INTERNAL_FIELDS, parse_body, prefill_body, sanitize
from pdserve_runtime.router.tokens import Held, describe_prompt, prompt_tokens, uncached_tokens
from pdserve_runtime.router.validate import problem

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=30,
)
messages = st.lists(
    st.dictionaries(
        st.sampled_from(["role", "content", "name"]),
        json_values | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": json_values}), max_size=3),
        max_size=3,
    )
    | json_values,
    max_size=4,
)
bodies = st.fixed_dictionaries(
    {},
    optional={
        "prompt": json_values | st.lists(st.integers(0, 50000), max_size=40) | st.text(max_size=300),
        "messages": messages,
        "stream": json_values,
        "kv_transfer_params": json_values,
        "ec_transfer_params": json_values,
        "max_tokens": json_values,
    },
)


@settings(max_examples=300, deadline=None)
@given(body=bodies, chat=st.booleans(), block=st.integers(1, 64))
def test_request_analysis_never_raises(body: dict[str, Any], chat: bool, block: int) -> None:
    raw = orjson.dumps(body)
    payload = parse_body(raw)
    problem(payload, chat)
    if sanitize(payload):
        raw = orjson.dumps(payload)
    assert not set(ENGINE_INTERNAL_FIELDS) & payload.keys()
    info = describe_prompt(payload, chat, block)
    assert prompt_tokens(info) >= 0
    held = Held(len(info.key) // 2, None) if len(info.key) > 2 else None
    assert uncached_tokens(info, held, 64).tokens >= 0
    step1 = orjson.loads(b"".join(bytes(part) for part in prefill_body(raw, payload, chat)))
    assert step1["max_tokens"] == 1 and step1["stream"] is False


@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=200))
def test_arbitrary_bytes_parse_or_raise_value_error(raw: bytes) -> None:
    try:
        payload = parse_body(raw)
    except ValueError:
        return
    assert isinstance(payload, dict)
