"""Pure transformations of request bodies, headers and engine answers on their way through the router.

- `parse_body`: the client's JSON object, or a client-readable reason.
- `sanitize`: remove fields only the router may set. `kv_transfer_params` would let a client make a decode engine
  pull KV blocks from any host it names (KNOWLEDGE.md); `ec_transfer_params` is vLLM's analogous encoder-cache
  directive. Both are removed at the top level and inside `vllm_xargs`, which vLLM copies into the sampling
  parameters' extra arguments, where the connector reads them too.
- `prefill_body` / `decode_body`: the 3-step PD flow's bodies, spliced onto the client's own bytes: the object's
  closing brace is replaced by the router's members. JSON parsers keep the last of duplicate members (Python's
  json, pydantic, orjson all do), so an appended `"max_tokens":1` overrides the client's. The client's bytes are
  forwarded untouched, never re-encoded: a long prompt costs one copy into the socket, not a parse and a dump.
  Bodies are lists of buffers written with one `writelines`.
- `engine_kv_params`: the prefill answer's `kv_transfer_params`, checked before a decode engine acts on them:
  a JSON object whose `remote_host` is an address of the prefill engine the router chose (a decode engine pulls
  from wherever it says) and whose `remote_port` is a port number (one of `allowed_ports` when given).
- `upstream_headers`: the client headers an engine may see, by allow-list (`Authorization` for engines started
  with an API key, `Accept`, W3C trace context); never cookies, forwarding headers or anything else.
- `request_id`: a well-formed client request id is kept for logs and the answer; engines get the router's own.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import Any

import orjson

# Fields a client must never set: they steer engine-to-engine transfers.
ENGINE_INTERNAL_FIELDS = ("kv_transfer_params", "ec_transfer_params")
# vLLM copies this object into the sampling parameters' extra args (where the KV connector also looks).
EXTRA_ARGS_FIELD = "vllm_xargs"

# What vLLM's NixlConnector expects on the prefill request (KNOWLEDGE.md, step 1).
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_PREFILL_MEMBERS = (
    b'"max_tokens":1,"stream":false,"stream_options":null,"min_tokens":0,"kv_transfer_params":'
    + orjson.dumps(PREFILL_KV_TRANSFER_PARAMS)
)
_CHAT_PREFILL_MEMBERS = b'"max_completion_tokens":1,' + _PREFILL_MEMBERS

# Client headers an engine may see (lower case), besides the ones the router sets itself.
FORWARDED_HEADERS = ("authorization", "accept", "traceparent", "tracestate")

# orjson writes at most this nesting; bodies the router re-encodes (stripped fields) must stay within it.
_MAX_NESTING = 254
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:/+=@-]{1,128}$")
_WHITESPACE = b" \t\r\n"

Body = list[bytes | bytearray | memoryview]


def parse_body(raw: bytes | bytearray) -> dict[str, Any]:
    """The request's JSON object, or ValueError with a client-readable reason."""
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise ValueError("request body must be a JSON object")
    # orjson reads up to 1024 levels of nesting but writes at most 254, and the router re-encodes a body it strips.
    # Reject what could not be forwarded on every route alike (counting brackets first: two C scans).
    if raw.count(b"[") + raw.count(b"{") > _MAX_NESTING:
        try:
            orjson.dumps(payload)
        except orjson.JSONEncodeError:
            raise ValueError("request body nests JSON deeper than the router can forward (254 levels)") from None
    return payload


def sanitize(payload: dict[str, Any]) -> bool:
    """Remove engine-internal fields in place, at the top level and in `vllm_xargs`. True when any was there."""
    removed = False
    for name in ENGINE_INTERNAL_FIELDS:
        if name in payload:
            del payload[name]
            removed = True
    extra = payload.get(EXTRA_ARGS_FIELD)
    if isinstance(extra, dict):
        for name in ENGINE_INTERNAL_FIELDS:
            if name in extra:
                del extra[name]
                removed = True
    return removed


def _splice(raw: bytes | bytearray, members: bytes, empty: bool) -> Body:
    """`raw` (a JSON object) with `members` added before its closing brace, as buffers (no copy of `raw`)."""
    end = len(raw) - 1
    while end > 0 and raw[end] in _WHITESPACE:
        end -= 1
    if empty:
        return [b"{" + members + b"}"]
    return [memoryview(raw)[:end], b"," + members + b"}"]


def prefill_body(raw: bytes | bytearray, payload: Mapping[str, Any], chat: bool) -> Body:
    """Step 1: the client's request cut to one token, not streamed, asking the engine to keep the KV."""
    return _splice(raw, _CHAT_PREFILL_MEMBERS if chat else _PREFILL_MEMBERS, not payload)


def decode_body(raw: bytes | bytearray, payload: Mapping[str, Any], kv_transfer_params: Mapping[str, Any]) -> Body:
    """Step 3: the client's original request plus the prefill engine's kv_transfer_params."""
    return _splice(raw, b'"kv_transfer_params":' + orjson.dumps(kv_transfer_params), not payload)


def engine_kv_params(
    answer: bytes, allowed_hosts: Collection[str], allowed_ports: Collection[int] = ()
) -> dict[str, Any] | str:
    """The checked `kv_transfer_params` of a prefill answer, or why they must not reach a decode engine."""
    try:
        parsed = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return "the prefill answer is not JSON"
    params = parsed.get("kv_transfer_params") if isinstance(parsed, dict) else None
    if not isinstance(params, dict):
        return "the prefill answer carries no kv_transfer_params"
    host = params.get("remote_host")
    if host is not None and (not isinstance(host, str) or host.strip("[]") not in allowed_hosts):
        return "kv_transfer_params.remote_host is not an address of the prefill engine"
    port = params.get("remote_port")
    if port is not None and (
        isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536
        or (allowed_ports and port not in allowed_ports)
    ):  # fmt: skip
        return "kv_transfer_params.remote_port is not the prefill engine's side-channel port"
    return params


def request_id(incoming: str | None, generate: Any) -> str:
    """Keep a well-formed client request id (logs and the answer), else make one."""
    if incoming and _REQUEST_ID.match(incoming):
        return incoming
    return str(generate())


def upstream_headers(incoming: Mapping[str, str]) -> bytes:
    """The header lines of an engine request: the allow-listed client headers, JSON content, no compression."""
    lines = [b"content-type: application/json\r\naccept-encoding: identity\r\n"]
    for name in FORWARDED_HEADERS:
        value = incoming.get(name)
        if value is not None:
            lines.append(f"{name}: {value}\r\n".encode("latin-1", "replace"))
    return b"".join(lines)
