"""OpenAI/vLLM-shaped error bodies, for plain HTTP answers and for errors inside an SSE stream.

Clients (the OpenAI SDKs, vLLM's own benchmarks) parse `{"error": {"message", "type", "param", "code"}}`; a router
that answers with anything else turns a clear failure into a confusing client-side exception.
"""

from __future__ import annotations

from http import HTTPStatus

import orjson

_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    413: "RequestEntityTooLargeError",
    415: "UnsupportedMediaTypeError",
    429: "RateLimitError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_payload(status: int, message: str, *, param: str | None = None) -> dict[str, object]:
    """The JSON object of an OpenAI-style error."""
    kind = _TYPES.get(status) or (HTTPStatus(status).phrase.replace(" ", "") + "Error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def stream_error_event(status: int, message: str) -> bytes:
    """The bytes that end a broken SSE stream: an error event, then `[DONE]` (what vLLM itself sends)."""
    return b"data: " + orjson.dumps(error_payload(status, message)) + b"\n\ndata: [DONE]\n\n"


def error_body(status: int, message: str) -> bytes:
    """The bytes of an OpenAI-style error answer (what the transport answers its own refusals with)."""
    return orjson.dumps(error_payload(status, message))
