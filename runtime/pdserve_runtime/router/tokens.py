r"""The router's model of a prompt: approximate tokens and the hashes of its full token blocks.

The router has no tokenizer (it must not load model files, and a real tokenizer would cost more CPU than the
rest of the request path). It only needs two things, and an approximation serves both:

- a prompt length in tokens, to compare the uncached part against the disaggregation threshold;
- block hashes that are equal for equal prompt prefixes, to track which engine holds which prefix.

Approximation: `pdserve.api.prompt` defines the tokens and the chat template (the engine simulator counts with
the same definition, so thresholds mean the same tokens there). Token-id prompts (`prompt: [1, 2, 3]`) are used
as they are; chat requests are flattened with the shared template, text parts only.

Blocks: the tokens are cut into full blocks of `block_size` (a partial tail block is never cached by vLLM, so it
is not hashed) and each block hash chains the previous one, so a block hash stands for the whole prefix up to
and including that block, as in vLLM's prefix cache. Python's `hash` is process-salted for strings; that is fine
because hashes never leave the router process.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from pdserve.api.prompt import chat_prompt, text_tokens


@dataclass(frozen=True, slots=True)
class PromptInfo:
    """What the routing policies know about one request's prompt."""

    tokens: int
    block_hashes: tuple[int, ...]
    block_size: int


def _content_text(content: object) -> str:
    """The text of a chat message's content: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text"]
        return " ".join(part for part in parts if isinstance(part, str))
    return ""


def prompt_tokens(payload: dict[str, object], chat: bool) -> Sequence[Hashable]:
    """The approximate token sequence of a completions or chat request body (already validated as a dict)."""
    if chat:
        messages = payload.get("messages")
        if not isinstance(messages, list):
            return []
        pairs = [
            (str(message.get("role", "")), _content_text(message.get("content")))
            for message in messages
            if isinstance(message, dict)
        ]
        return text_tokens(chat_prompt(pairs))
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return text_tokens(prompt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(item, int) for item in prompt):
            return prompt  # already token ids
        # A batch of prompts: the engines see each, but for routing their concatenation is a fair estimate.
        flat: list[Hashable] = []
        for item in prompt:
            if isinstance(item, str):
                flat.extend(text_tokens(item))
            elif isinstance(item, list):
                flat.extend(token for token in item if isinstance(token, int))
        return flat
    return []


def block_hashes(tokens: Sequence[Hashable], block_size: int) -> tuple[int, ...]:
    """Chained hashes of the full `block_size` blocks of `tokens`."""
    hashes: list[int] = []
    previous = 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        previous = hash((previous, tuple(tokens[start : start + block_size])))
        hashes.append(previous)
    return tuple(hashes)


def describe_prompt(payload: dict[str, object], chat: bool, block_size: int) -> PromptInfo:
    """Token count and block hashes of a request body."""
    tokens = prompt_tokens(payload, chat)
    return PromptInfo(tokens=len(tokens), block_hashes=block_hashes(tokens, block_size), block_size=block_size)
