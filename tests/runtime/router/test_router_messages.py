"""Pure request/response transformations: sanitising, the PD bodies, header filtering, request ids."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from pdserve_runtime.router.messages import (
    PREFILL_KV_TRANSFER_PARAMS,
    decode_body,
    downstream_headers,
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
    ],
)
def test_sanitize_strips_engine_internal_fields(payload: dict[str, Any], removed: bool, left: dict[str, Any]) -> None:
    assert sanitize(payload) is removed
    assert payload == left


@pytest.mark.parametrize("chat", [False, True])
def test_prefill_body_is_step_one_of_the_pd_flow(chat: bool) -> None:
    client = {
        "prompt": "x",
        "max_tokens": 50,
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": 5,
    }
    body = orjson.loads(prefill_body(client, chat))
    assert body["max_tokens"] == 1
    assert body["stream"] is False
    assert "stream_options" not in body and "min_tokens" not in body
    assert body["kv_transfer_params"] == PREFILL_KV_TRANSFER_PARAMS
    assert ("max_completion_tokens" in body) is chat
    assert client["max_tokens"] == 50  # the client's body is untouched for step 3


def test_decode_body_adds_the_prefill_params_unchanged() -> None:
    params = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]], "remote_port": 5601, "remote_host": "10.0.0.5"}
    body = orjson.loads(decode_body({"prompt": "x", "max_tokens": 50, "stream": True}, params))
    assert body == {"prompt": "x", "max_tokens": 50, "stream": True, "kv_transfer_params": params}


def test_upstream_headers_drop_hop_by_hop_and_keep_authorization() -> None:
    incoming = CIMultiDictProxy(
        CIMultiDict(
            {
                "Authorization": "Bearer secret",
                "Connection": "keep-alive, X-Private",
                "X-Private": "drop me",
                "Keep-Alive": "timeout=5",
                "Transfer-Encoding": "chunked",
                "Host": "router",
                "Content-Length": "12",
                "Accept-Encoding": "gzip",
                "X-Tenant": "t1",
                "traceparent": "00-abc-def-01",
            }
        )
    )
    out = upstream_headers(incoming, "rid-1")
    assert out == {
        "Authorization": "Bearer secret",
        "X-Tenant": "t1",
        "traceparent": "00-abc-def-01",
        "Content-Type": "application/json",
        "X-Request-Id": "rid-1",
    }


def test_downstream_headers_add_the_route_and_id() -> None:
    upstream = CIMultiDictProxy(
        CIMultiDict({"Content-Type": "text/event-stream", "Transfer-Encoding": "chunked", "Server": "uvicorn"})
    )
    out = downstream_headers(upstream, "rid-2", "pd")
    assert dict(out) == {"Content-Type": "text/event-stream", "X-Request-Id": "rid-2", "X-Pdserve-Route": "pd"}


@pytest.mark.parametrize(
    ("incoming", "kept"),
    [("abc-123", True), ("a" * 128, True), ("a" * 129, False), ("bad\nid", False), ("", False), (None, False)],
)
def test_request_ids_are_propagated_when_well_formed(incoming: str | None, kept: bool) -> None:
    result = request_id(incoming, lambda: "generated")
    assert result == (incoming if kept else "generated")
