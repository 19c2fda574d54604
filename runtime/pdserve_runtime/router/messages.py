"""Pure transformations of request bodies and headers on their way to the engines.

- `sanitize`: remove fields only the router may set. `kv_transfer_params` would let a client make a decode
  engine pull KV blocks from any host it names (KNOWLEDGE.md); `ec_transfer_params` is vLLM's analogous encoder-
  cache transfer directive. Both are engine-internal.
- `prefill_body`: the 3-step PD flow's step 1 (max_tokens 1, no stream, do_remote_decode).
- `decode_body`: step 3, the client's body plus the prefill's `kv_transfer_params` unchanged.
- `upstream_headers` / `downstream_headers`: end-to-end headers only (RFC 9110 section 7.6.1 hop-by-hop
  headers and the ones a `Connection` header names are dropped), Authorization passed through untouched.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import orjson
from multidict import CIMultiDict, CIMultiDictProxy

# Fields a client must never set: they steer engine-to-engine transfers.
ENGINE_INTERNAL_FIELDS = ("kv_transfer_params", "ec_transfer_params")

# What vLLM's NixlConnector expects on the prefill request (KNOWLEDGE.md, step 1).
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
# Recomputed by the router (or meaningless once re-sent): never copied from the client to an engine.
# `content-encoding`: the router's HTTP server has already decoded a gzip/deflate/br request body, and the router
# forwards plain JSON; passing the header on would label that plain body as compressed (engine 500s, which would
# then count against, and eject, healthy engines).
_NOT_FORWARDED_UP = _HOP_BY_HOP | {
    "host",
    "content-length",
    "content-type",
    "content-encoding",
    "accept-encoding",
    "expect",
    "x-request-id",
}
# Not copied from an engine's response to the client.
_NOT_FORWARDED_DOWN = _HOP_BY_HOP | {"content-length", "content-encoding", "date", "server", "x-request-id"}

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:/+=@-]{1,128}$")


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request's JSON object, or ValueError with a client-readable reason."""
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise ValueError("request body must be a JSON object")
    # orjson reads up to 1024 levels of nesting but writes at most 254, and the router re-encodes the body whenever
    # it changes it (the PD bodies, stripped fields). Reject here what could not be forwarded, whatever the route,
    # instead of failing later mid-request. Encoding a typical body takes well under a microsecond.
    try:
        orjson.dumps(payload)
    except orjson.JSONEncodeError:
        raise ValueError("request body nests JSON deeper than the router can forward (254 levels)") from None
    return payload


def sanitize(payload: dict[str, Any]) -> bool:
    """Remove engine-internal fields in place. Returns True when something was removed."""
    removed = False
    for name in ENGINE_INTERNAL_FIELDS:
        if name in payload:
            del payload[name]
            removed = True
    return removed


def prefill_body(payload: Mapping[str, Any], chat: bool) -> bytes:
    """Step 1: the client's request, cut to one token, not streamed, asking the engine to keep the KV."""
    body = dict(payload)
    body["max_tokens"] = 1
    if chat:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    body.pop("stream_options", None)
    body.pop("min_tokens", None)  # min_tokens > max_tokens is a 400 in vLLM
    body["kv_transfer_params"] = PREFILL_KV_TRANSFER_PARAMS
    return orjson.dumps(body)


def decode_body(payload: Mapping[str, Any], kv_transfer_params: Mapping[str, Any]) -> bytes:
    """Step 3: the client's original request plus the prefill engine's kv_transfer_params, unchanged."""
    return orjson.dumps({**payload, "kv_transfer_params": kv_transfer_params})


def request_id(incoming: str | None, generate: Any) -> str:
    """Propagate a well-formed client request id, else make one (ids end up in logs and headers)."""
    if incoming and _REQUEST_ID.match(incoming):
        return incoming
    return str(generate())


def _connection_named(headers: Mapping[str, str]) -> frozenset[str]:
    value = headers.get("connection")
    if not value:
        return frozenset()
    return frozenset(token.strip().lower() for token in value.split(","))


def upstream_headers(incoming: CIMultiDictProxy[str], rid: str) -> dict[str, str]:
    """Headers for an engine request: the client's end-to-end headers (Authorization included), JSON, the id."""
    named = _connection_named(incoming)
    out = {
        name: value
        for name, value in incoming.items()
        if name.lower() not in _NOT_FORWARDED_UP and name.lower() not in named
    }
    out["Content-Type"] = "application/json"
    out["X-Request-Id"] = rid
    return out


def downstream_headers(upstream: CIMultiDictProxy[str], rid: str, route: str) -> CIMultiDict[str]:
    """Headers for the client: the engine's end-to-end headers plus the router's decision and the id."""
    named = _connection_named(upstream)
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in upstream.items():
        lowered = name.lower()
        if lowered not in _NOT_FORWARDED_DOWN and lowered not in named:
            out.add(name, value)
    out["X-Request-Id"] = rid
    out["X-Pdserve-Route"] = route
    return out
