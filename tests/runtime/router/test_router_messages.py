"""Pure request/response transformations: sanitising, the spliced PD bodies, prefill answer checks, header
allow-list, request ids."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from pdserve_runtime.router.messages import (
    PREFILL_KV_TRANSFER_PARAMS,
    Body,
    decode_body,
    engine_kv_params,
    parse_body,
    prefill_body,
    request_id,
    sanitize,
    upstream_headers,
)


@pytest.mark.parametrize(
    ("raw", "error"),
    [(b"{", "not valid JSON"), (b"[1]", "JSON object"), (b'"x"', "JSON object"), (b"", "not valid JSON")],
)
def test_parse_body_rejects_non_objects(raw: bytes, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_body(raw)


@pytest.mark.parametrize(
    ("payload", "removed", "left"),
    [
        ({"prompt": "x"}, False, {"prompt": "x"}),
        ({"prompt": "x", "kv_transfer_params": {"remote_host": "evil"}}, True, {"prompt": "x"}),
        ({"prompt": "x", "ec_transfer_params": {}, "kv_transfer_params": None}, True, {"prompt": "x"}),
        # vLLM copies vllm_xargs into the sampling params' extra args, where the KV connector also reads them.
        (
            {"prompt": "x", "vllm_xargs": {"kv_transfer_params": {"remote_host": "evil"}, "seed_tag": 3}},
            True,
            {"prompt": "x", "vllm_xargs": {"seed_tag": 3}},
        ),
        ({"prompt": "x", "vllm_xargs": "not an object"}, False, {"prompt": "x", "vllm_xargs": "not an object"}),
    ],
)
def test_sanitize_strips_engine_internal_fields(payload: dict[str, Any], removed: bool, left: dict[str, Any]) -> None:
    assert sanitize(payload) is removed
    assert payload == left


def test_engine_internal_fields_are_found_in_every_spelling() -> None:
    """JSON escapes spell the same member: the check runs on the parsed keys, not on the bytes."""
    raw = b'{"prompt": "x", "kv\\u005ftransfer_params": {"remote_host": "evil"}}'
    payload = parse_body(raw)
    assert sanitize(payload) is True
    assert payload == {"prompt": "x"}


def _joined(parts: Body) -> bytes:
    return b"".join(bytes(part) for part in parts)


@pytest.mark.parametrize("chat", [False, True])
def test_prefill_body_is_step_one_of_the_pd_flow(chat: bool) -> None:
    client = {"prompt": "x", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True},
              "min_tokens": 5}  # fmt: skip
    raw = orjson.dumps(client) + b" \n"
    spliced = _joined(prefill_body(raw, client, chat))
    assert spliced.startswith(raw.rstrip()[:-1])  # the client's bytes, untouched
    body = json.loads(spliced)  # Python's json keeps the last of duplicate members, as vLLM's server does
    assert body["max_tokens"] == 1
    assert body["stream"] is False
    assert body["stream_options"] is None and body["min_tokens"] == 0
    assert body["kv_transfer_params"] == PREFILL_KV_TRANSFER_PARAMS
    assert ("max_completion_tokens" in body) is chat
    assert orjson.loads(spliced)["max_tokens"] == 1  # orjson too


def test_decode_body_adds_the_prefill_params_unchanged() -> None:
    params = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]], "remote_port": 5601, "remote_host": "10.0.0.5"}
    client = {"prompt": "x", "max_tokens": 50, "stream": True}
    body = json.loads(_joined(decode_body(orjson.dumps(client), client, params)))
    assert body == {**client, "kv_transfer_params": params}


def test_an_empty_object_is_spliced_too() -> None:
    assert json.loads(_joined(decode_body(b"{ }", {}, {"a": 1}))) == {"kv_transfer_params": {"a": 1}}


KV = {"do_remote_prefill": True, "remote_host": "10.0.0.5", "remote_port": 5600, "remote_block_ids": [[1]]}


@pytest.mark.parametrize(
    ("answer", "ports", "problem"),
    [
        ({"kv_transfer_params": KV}, (), None),
        ({"kv_transfer_params": {**KV, "remote_host": "[10.0.0.5]"}}, (), None),
        ({"kv_transfer_params": KV}, (5600, 5601), None),
        ({"kv_transfer_params": {**KV, "remote_host": "169.254.169.254"}}, (), "remote_host"),
        ({"kv_transfer_params": {**KV, "remote_host": 5}}, (), "remote_host"),
        ({"kv_transfer_params": {**KV, "remote_port": 70000}}, (), "remote_port"),
        ({"kv_transfer_params": {**KV, "remote_port": True}}, (), "remote_port"),
        ({"kv_transfer_params": KV}, (5601,), "remote_port"),
        ({"kv_transfer_params": None}, (), "no kv_transfer_params"),
        ({"choices": []}, (), "no kv_transfer_params"),
    ],
)
def test_prefill_answers_are_checked(answer: dict[str, Any], ports: tuple[int, ...], problem: str | None) -> None:
    result = engine_kv_params(orjson.dumps(answer), {"10.0.0.5", "prefill-0"}, ports)
    if problem is None:
        assert result == answer["kv_transfer_params"]
    else:
        assert isinstance(result, str) and problem in result


def test_a_prefill_answer_that_is_not_json_is_refused() -> None:
    assert engine_kv_params(b"<html>", {"h"}) == "the prefill answer is not JSON"


def test_upstream_headers_are_an_allow_list() -> None:
    incoming = {
        "authorization": "Bearer secret",
        "accept": "text/event-stream",
        "traceparent": "00-abc-def-01",
        "cookie": "session=1",
        "forwarded": "for=1.2.3.4",
        "x-forwarded-for": "1.2.3.4",
        "x-tenant": "t1",
        "host": "router",
        "content-length": "12",
        "x-request-id": "client-id",
    }
    lines = upstream_headers(incoming).decode().split("\r\n")
    assert [line for line in lines if line] == [
        "content-type: application/json",
        "accept-encoding: identity",
        "authorization: Bearer secret",
        "accept: text/event-stream",
        "traceparent: 00-abc-def-01",
    ]


@pytest.mark.parametrize(
    ("incoming", "kept"),
    [("abc-123", True), ("a" * 128, True), ("a" * 129, False), ("bad\nid", False), ("", False), (None, False)],
)
def test_request_ids_are_propagated_when_well_formed(incoming: str | None, kept: bool) -> None:
    result = request_id(incoming, lambda: "generated")
    assert result == (incoming if kept else "generated")
