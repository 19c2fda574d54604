r"""The router's model of a prompt: approximate tokens and the hashes of its full token blocks.

The router has no tokenizer (it must not load model files, and a real tokenizer would cost more CPU than the
rest of the request path). It only needs two things, and an approximation serves both:

- a prompt length in tokens, to compare the uncached part against the disaggregation threshold;
- block hashes that are equal for equal prompt prefixes, to track which engine holds which prefix.

Approximation (the same rules as the engine simulator's tokenizer, so thresholds mean the same tokens there):
the text is split into pieces with `\w+|[^\w\s]` (runs of word characters, single punctuation characters);
a piece of n characters is ceil(n / 6) tokens (its 6-character slices), so "Hello, world!" is 4 tokens and
"internationalization" is 4. Against a real BPE tokenizer this is within a few tens of percent for English,
well inside the slack of a threshold. Token-id prompts (`prompt: [1, 2, 3]`) are used as they are. Chat requests
are flattened with the simulator's template (`<|role|>` line, content, newline; then `<|assistant|>`), text
parts only.

Blocks: the tokens are cut into full blocks of `block_size` (a partial tail block is never cached by vLLM, so it
is not hashed) and each block hash chains the previous one, so a block hash stands for the whole prefix up to
and including that block, as in vLLM's prefix cache. Python's `hash` is process-salted for strings; that is fine
because hashes never leave the router process.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

# Runs of word characters in slices of at most 6, or one other non-space character. Greedy `\w{1,6}` cuts a run
# of n word characters into exactly the ceil(n / 6) slices of the simulator's rule, in C instead of a loop.
_TOKENS = re.compile(r"\w{1,6}|[^\w\s]")


@dataclass(frozen=True, slots=True)
class PromptInfo:
    """What the routing policies know about one request's prompt."""

    tokens: int
    block_hashes: tuple[int, ...]
    block_size: int


def text_tokens(text: str) -> list[str]:
    """Split text into approximate tokens (pieces, long pieces cut into 6-character slices)."""
    return _TOKENS.findall(text)


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
        parts = [
            f"<|{message.get('role', '')}|>\n{_content_text(message.get('content'))}\n"
            for message in messages
            if isinstance(message, dict)
        ]
        parts.append("<|assistant|>\n")
        return text_tokens("".join(parts))
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
