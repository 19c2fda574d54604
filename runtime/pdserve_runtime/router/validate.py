"""Checks of a generation request the router makes before any engine works on it.

Why the router validates at all: on the PD route a request reaches the prefill engine with `max_tokens: 1` and no
`stream`, so a request the decode engine would refuse (`max_tokens: -5`, `"stream": "yes"`, `min_tokens` above
`max_tokens`, `n: 0`) still costs a full prefill, and the prefill engine then holds its KV for the whole lease.
Refusing it here costs nothing. The rules are the ones vLLM's OpenAI server applies to these fields (types and
ranges), so nothing an engine would accept is refused; fields the router does not know pass through untouched.

`problem(payload, chat)` returns (message, parameter) or None; a rule table keeps every rule one line.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

Check = Callable[[Any], str | None]


def _integer(minimum: int | None = None, maximum: int | None = None) -> Check:
    def check(value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int):
            return "must be an integer"
        if minimum is not None and value < minimum:
            return f"must be at least {minimum}, got {value}"
        if maximum is not None and value > maximum:
            return f"must be at most {maximum}, got {value}"
        return None

    return check


def _number(minimum: float | None = None, maximum: float | None = None, above: float | None = None) -> Check:
    def check(value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return "must be a number"
        if minimum is not None and value < minimum:
            return f"must be at least {minimum:g}, got {value:g}"
        if above is not None and value <= above:
            return f"must be greater than {above:g}, got {value:g}"
        if maximum is not None and value > maximum:
            return f"must be at most {maximum:g}, got {value:g}"
        return None

    return check


def _boolean(value: Any) -> str | None:
    return None if isinstance(value, bool) else "must be true or false"


def _string(value: Any) -> str | None:
    return None if isinstance(value, str) else "must be a string"


def _object(value: Any) -> str | None:
    return None if isinstance(value, dict) else "must be an object"


def _stop(value: Any) -> str | None:
    if isinstance(value, str) or (isinstance(value, list) and all(isinstance(item, str) for item in value)):
        return None
    return "must be a string or a list of strings"


def _prompt(value: Any) -> str | None:
    if isinstance(value, str):
        return None
    if isinstance(value, list) and value:
        if all(isinstance(item, str) for item in value):
            return None
        if all(type(item) is int for item in value):
            return None
        if all(isinstance(item, list) and item and all(type(token) is int for token in item) for item in value):
            return None
    return "must be a string, a list of strings, a list of token ids or a list of lists of token ids"


def _messages(value: Any) -> str | None:
    if not isinstance(value, list) or not value:
        return "must be a non-empty list of messages"
    for message in value:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return "must hold objects with a string role"
    return None


# Field -> check, for fields present and not null. (vLLM: SamplingParams._verify_args and the request models.)
_COMMON: dict[str, Check] = {
    "model": _string,
    "max_tokens": _integer(1),
    "min_tokens": _integer(0),
    "n": _integer(1),
    "stream": _boolean,
    "stream_options": _object,
    "temperature": _number(0.0),
    "top_p": _number(above=0.0, maximum=1.0),
    "top_k": _integer(-1),
    "min_p": _number(0.0, 1.0),
    "presence_penalty": _number(-2.0, 2.0),
    "frequency_penalty": _number(-2.0, 2.0),
    "repetition_penalty": _number(above=0.0),
    "seed": _integer(),
    "stop": _stop,
    "ignore_eos": _boolean,
    "vllm_xargs": _object,
    "user": _string,
}
_COMPLETIONS: dict[str, Check] = {**_COMMON, "logprobs": _integer(0), "echo": _boolean, "best_of": _integer(1)}
_CHAT: dict[str, Check] = {
    **_COMMON,
    "max_completion_tokens": _integer(1),
    "logprobs": _boolean,
    "top_logprobs": _integer(0),
}


def problem(payload: Mapping[str, Any], chat: bool) -> tuple[str, str] | None:
    """Why the request is invalid and which parameter, or None when the router has nothing against it."""
    required, check_required = ("messages", _messages) if chat else ("prompt", _prompt)
    value = payload.get(required)
    if value is None and not (not chat and payload.get("prompt_embeds") is not None):
        return f"{required} is required", required
    if value is not None and (reason := check_required(value)) is not None:
        return f"{required} {reason}", required
    for name, check in (_CHAT if chat else _COMPLETIONS).items():
        field = payload.get(name)
        if field is not None and (reason := check(field)) is not None:
            return f"{name} {reason}", name
    limit = payload.get("max_completion_tokens") if chat else None
    if limit is None:
        limit = payload.get("max_tokens")
    minimum = payload.get("min_tokens")
    if isinstance(limit, int) and isinstance(minimum, int) and minimum > limit:
        return f"min_tokens ({minimum}) must not exceed max_tokens ({limit})", "min_tokens"
    if payload.get("stream_options") is not None and payload.get("stream") is not True:
        return "stream_options can only be set when stream is true", "stream_options"
    return None
