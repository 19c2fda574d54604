"""Parsing and validating OpenAI requests the way vLLM's server does, and vLLM-shaped error bodies.

vLLM answers a malformed request with HTTP 400 and ``{"error": {"message", "type": "BadRequestError",
"param", "code": 400}}``; an unknown model with 404 ``NotFoundError``; an engine failure with 500
``InternalServerError``. ``code`` is the HTTP status (an int), as in vLLM's ``ErrorInfo``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pdserve_sim.engine import RemotePrefill
from pdserve_sim.tokenizer import VOCAB_OFFSET, VOCAB_SIZE, flatten_chat, tokenize

_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    408: "RequestTimeout",
    422: "UnprocessableEntityError",
    429: "TooManyRequests",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailable",
}


class ApiError(Exception):
    """An error to send to the client as a vLLM-shaped error body."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        """The JSON body vLLM sends for this error."""
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """``{"error": {...}}`` in vLLM's shape."""
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError"),
            "param": param,
            "code": status,
        }
    }


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated completion or chat request."""

    chat: bool
    model: str
    prompt_ids: list[int]
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool
    remote_decode: bool
    remote_prefill: RemotePrefill | None
    has_kv_transfer_params: bool
    echo_prompt: str | None


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def _opt_int(body: dict[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"{name} must be an integer", name)
    if value < minimum:
        raise _bad(f"{name} must be at least {minimum}, got {value}.", name)
    return value


def _opt_bool(body: dict[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise _bad(f"{name} must be a boolean", name)
    return value


def _opt_number(body: dict[str, Any], name: str) -> None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise _bad(f"{name} must be a number", name)


def decode_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad(f"JSON decode error: {exc}") from None
    if not isinstance(body, dict):
        raise _bad("The request body must be a JSON object.")
    return body


def _prompt_ids(body: dict[str, Any]) -> tuple[list[int], str | None]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return tokenize(prompt), prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            for t in prompt:
                if not 0 <= t < VOCAB_OFFSET + VOCAB_SIZE:
                    raise _bad(f"Token id {t} is out of vocabulary", "prompt")
            return list(prompt), None
        if len(prompt) == 1:
            only = prompt[0]
            if isinstance(only, str):
                return tokenize(only), only
            if isinstance(only, list) and only and all(isinstance(t, int) and not isinstance(t, bool) for t in only):
                return list(only), None
        raise _bad("The simulator serves one prompt per request (a string or a list of token ids).", "prompt")
    raise _bad("prompt must be a non-empty string or list of token ids", "prompt")


def _chat_ids(body: dict[str, Any]) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list", "messages")
    flat: list[tuple[str, str]] = []
    for msg in messages:
        if not isinstance(msg, dict):
            raise _bad("each message must be an object", "messages")
        role = msg.get("role")
        if not isinstance(role, str):
            raise _bad("each message needs a string role", "messages")
        content = msg.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts: list[str] = []
            for part in content:
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise _bad("content parts must be objects with a type", "messages")
                if part["type"] == "text":
                    if not isinstance(part.get("text"), str):
                        raise _bad("a text content part needs a string text", "messages")
                    parts.append(part["text"])
            text = "\n".join(parts)
        else:
            raise _bad("message content must be a string, a list of parts or null", "messages")
        flat.append((role, text))
    return tokenize(flatten_chat(flat))


def _kv_params(body: dict[str, Any]) -> tuple[bool, RemotePrefill | None, bool]:
    params = body.get("kv_transfer_params")
    if params is None:
        return False, None, False
    if not isinstance(params, dict):
        raise _bad("kv_transfer_params must be an object", "kv_transfer_params")
    remote_decode = bool(params.get("do_remote_decode"))
    if not params.get("do_remote_prefill"):
        return remote_decode, None, True
    try:
        host = params["remote_host"]
        port = params["remote_port"]
        request_id = params["remote_request_id"]
        block_ids = params.get("remote_block_ids") or []
        if not isinstance(host, str) or not host:
            raise ValueError("remote_host")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError("remote_port")
        if not isinstance(request_id, str):
            raise ValueError("remote_request_id")
        # vLLM sends one list of block ids per KV cache group; the simulator has one group.
        if block_ids and isinstance(block_ids[0], list):
            block_ids = [b for group in block_ids for b in group]
        if not all(isinstance(b, int) and not isinstance(b, bool) for b in block_ids):
            raise ValueError("remote_block_ids")
        num_tokens = params.get("remote_num_tokens")
        remote = RemotePrefill(
            engine_id=str(params.get("remote_engine_id") or ""),
            request_id=request_id,
            host=host,
            port=port,
            block_ids=tuple(block_ids),
            num_tokens=num_tokens if isinstance(num_tokens, int) else None,
        )
    except (KeyError, ValueError, TypeError, IndexError) as exc:
        raise _bad(f"kv_transfer_params for a remote prefill are incomplete or invalid: {exc}") from None
    return remote_decode, remote, True


def parse_request(
    body: dict[str, Any], *, chat: bool, model_names: tuple[str, ...], max_model_len: int
) -> ParsedRequest:
    """Validate a completion (``chat=False``) or chat request body; raises ApiError."""
    model = body.get("model")
    if model is None:
        model = model_names[0]
    elif not isinstance(model, str):
        raise _bad("model must be a string", "model")
    elif model not in model_names:
        raise ApiError(404, f"The model `{model}` does not exist.", "model")

    echo_prompt: str | None = None
    if chat:
        prompt_ids = _chat_ids(body)
        max_tokens = _opt_int(body, "max_completion_tokens", 1)
        if max_tokens is None:
            max_tokens = _opt_int(body, "max_tokens", 1)
    else:
        prompt_ids, echo_prompt = _prompt_ids(body)
        max_tokens = _opt_int(body, "max_tokens", 1)
        if max_tokens is None and "max_tokens" not in body:
            max_tokens = 16
    if not prompt_ids:
        raise _bad("The prompt is empty.", "messages" if chat else "prompt")
    n = _opt_int(body, "n", 1)
    if n not in (None, 1):
        raise _bad("The simulator supports n=1 only.", "n")
    min_tokens = _opt_int(body, "min_tokens", 0) or 0
    ignore_eos = bool(_opt_bool(body, "ignore_eos"))
    stream = bool(_opt_bool(body, "stream"))
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        _opt_number(body, name)
    options = body.get("stream_options")
    include_usage = continuous = False
    if options is not None:
        if not isinstance(options, dict):
            raise _bad("stream_options must be an object", "stream_options")
        if not stream:
            raise _bad("Stream options can only be defined when `stream=True`.", "stream_options")
        include_usage = bool(_opt_bool(options, "include_usage"))
        continuous = bool(_opt_bool(options, "continuous_usage_stats"))

    prompt_len = len(prompt_ids)
    if max_tokens is None:
        max_tokens = max_model_len - prompt_len
    if prompt_len + max_tokens > max_model_len or max_tokens < 1:
        raise _bad(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max(max_tokens, 1)} tokens ({prompt_len} in the messages, {max_tokens} in the "
            "completion). Please reduce the length of the messages or completion.",
            "max_tokens" if "max_tokens" in body else None,
        )
    if min_tokens > max_tokens:
        raise _bad(f"min_tokens ({min_tokens}) must be less than or equal to max_tokens ({max_tokens}).", "min_tokens")
    remote_decode, remote_prefill, has_kv = _kv_params(body)
    return ParsedRequest(
        chat=chat,
        model=model,
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        remote_decode=remote_decode,
        remote_prefill=remote_prefill,
        has_kv_transfer_params=has_kv,
        echo_prompt=echo_prompt,
    )
