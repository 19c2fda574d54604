"""Does a request's prompt plus its output budget fit the served context length? Decided before prefill works.

Why: on the PD route the prefill engine computes the prompt and keeps its KV for the decode engine, and only the
decode engine checks prompt + `max_tokens` against its context (vLLM: `'max_tokens' or 'max_completion_tokens'
is too large`). A request that does not fit is refused there after prefill worked, and the prefill engine holds
its KV until the lease expires. The router refuses it first, with the answer vLLM would give.

The router has no tokenizer, so it decides with what is certain and asks an engine only when it cannot:

- the output budget is vLLM's: chat reads `max_completion_tokens`, else `max_tokens`; completions read
  `max_tokens`, which defaults to 16 when absent; none (or null) means "what is left", which always fits;
- token-id prompts have an exact count;
- a text prompt has at least one token and at most one per UTF-8 byte (every tokenizer an engine serves maps a
  byte to at most one token), plus special tokens, and for chat the template's own (counted generously). The
  request body's length stands for the prompt's bytes (it holds them, and JSON escapes only lengthen text), so
  the bound costs no pass over the prompt;
- so `max_tokens` at or above the context length is refused without counting, a prompt that fits even at one
  token per byte passes without counting, and between the two (`Verdict.ASK`) the proxy asks an engine's
  `/tokenize` for the exact count (vLLM's and the simulator's), with the same chat template inputs. Requests
  carrying anything but text (images, audio) are left to the engines, as are batches of text prompts.

A wrong guess here can only ever let a request through to the engines' own check, never refuse one an engine
would serve: every refusal rests on a count that is exact or a lower bound.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Tokens a chat template may add besides the messages' own (a default system prompt, tool instructions).
_TEMPLATE_TOKENS = 1024
_TOKENS_PER_MESSAGE = 16
# Special tokens a completions prompt may get (BOS, EOS).
_SPECIAL_TOKENS = 16
# vLLM's CompletionRequest.max_tokens default.
_COMPLETIONS_DEFAULT_OUTPUT = 16
# Chat fields that change what the template renders, passed to /tokenize as given (vLLM's TokenizeChatRequest).
_CHAT_TEMPLATE_FIELDS = (
    "add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template", "chat_template_kwargs",
)  # fmt: skip


class Verdict(enum.Enum):
    FITS = "fits"
    REFUSE = "refuse"
    ASK = "ask"  # count the prompt's tokens with an engine's /tokenize


@dataclass(frozen=True, slots=True)
class Budget:
    """What a request asks of the context: its output budget and what is known of its prompt's tokens."""

    output: int | None  # None: the rest of the context (always fits)
    param: str  # the field that set it, for the error
    exact: int | None  # the prompt's tokens, when token ids were sent
    upper: int | None  # at most this many prompt tokens; None: unknown (not text only)
    tokenize: dict[str, Any] | None  # the /tokenize body that counts it exactly; None: cannot be counted


def budget(payload: Mapping[str, Any], chat: bool, body_bytes: int) -> Budget:
    """The request's output budget and prompt bounds (`payload` has passed `validate.problem`)."""
    if chat:
        param = "max_completion_tokens" if payload.get("max_completion_tokens") else "max_tokens"
        output = payload.get("max_completion_tokens") or payload.get("max_tokens")
        messages = payload.get("messages")
        count = len(messages) if isinstance(messages, list) else 0
        text_only = isinstance(messages, list) and all(_text_only(message) for message in messages)
        upper = body_bytes + _TEMPLATE_TOKENS + _TOKENS_PER_MESSAGE * count if text_only else None
        request: dict[str, Any] | None = None
        if text_only:
            request = {"messages": messages}
            if payload.get("tools") and payload.get("tool_choice") != "none":
                request["tools"] = payload["tools"]  # (tools a template leaves out only make the count lower)
            request.update({name: payload[name] for name in _CHAT_TEMPLATE_FIELDS if payload.get(name) is not None})
        return Budget(_int_or_none(output), param, None, upper, _with_model(request, payload))
    output = payload.get("max_tokens", _COMPLETIONS_DEFAULT_OUTPUT)  # absent: 16; null: the rest of the context
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt and all(type(item) is int for item in prompt):
        return Budget(_int_or_none(output), "max_tokens", len(prompt), None, None)
    if isinstance(prompt, list) and prompt and all(isinstance(item, list) for item in prompt):
        return Budget(_int_or_none(output), "max_tokens", max(len(item) for item in prompt), None, None)
    if isinstance(prompt, str):
        upper = body_bytes + _SPECIAL_TOKENS  # the body holds the prompt's bytes (escapes only lengthen them)
        request = {"prompt": prompt}
        if payload.get("add_special_tokens") is not None:
            request["add_special_tokens"] = payload["add_special_tokens"]
        return Budget(_int_or_none(output), "max_tokens", None, upper, _with_model(request, payload))
    if isinstance(prompt, list) and prompt and all(isinstance(item, str) for item in prompt):
        return Budget(_int_or_none(output), "max_tokens", None, body_bytes + _SPECIAL_TOKENS, None)
    return Budget(_int_or_none(output), "max_tokens", None, None, None)


def verdict(need: Budget, context_length: int) -> Verdict:
    """Whether the request fits `context_length`, cannot fit, or needs its prompt counted."""
    output = need.output
    if output is None:
        return Verdict.FITS
    if need.exact is not None:
        return Verdict.REFUSE if need.exact + output > context_length else Verdict.FITS
    if output >= context_length:
        return Verdict.REFUSE  # a prompt has at least one token
    if need.upper is not None and need.upper + output <= context_length:
        return Verdict.FITS
    return Verdict.ASK if need.tokenize is not None else Verdict.FITS


def counted_verdict(need: Budget, context_length: int, prompt_tokens: int) -> Verdict:
    """The verdict once the prompt's tokens are counted."""
    output = need.output
    return Verdict.REFUSE if output is not None and prompt_tokens + output > context_length else Verdict.FITS


def refusal(need: Budget, context_length: int, prompt_tokens: int | None) -> str:
    """vLLM's message for a request whose prompt plus output budget exceeds the context."""
    head = (
        f"'max_tokens' or 'max_completion_tokens' is too large: {need.output}. This model's maximum context length "
        f"is {context_length} tokens"
    )
    if prompt_tokens is None:
        return head + "."
    return (
        f"{head} and your request has {prompt_tokens} input tokens ({need.output} > {context_length} - "
        f"{prompt_tokens})."
    )


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text_only(message: Any) -> bool:
    if not isinstance(message, dict):
        return False
    content = message.get("content")
    if content is None or isinstance(content, str):
        return True
    return isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text" for part in content)


def _with_model(request: dict[str, Any] | None, payload: Mapping[str, Any]) -> dict[str, Any] | None:
    if request is not None and isinstance(payload.get("model"), str):
        request["model"] = payload["model"]
    return request
