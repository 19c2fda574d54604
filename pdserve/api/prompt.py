r"""The prompt model the PD router and the engine simulator share: how text becomes approximate tokens, and how a
chat request becomes one prompt.

The router must estimate a prompt's length in tokens (to compare its uncached part with the disaggregation
threshold) and cut it into blocks (to track which engine holds which prefix) without loading a tokenizer. The
engine simulator must count the same tokens, so that a threshold or a block boundary means the same thing to
both. This module is that shared definition; the router owns its use, the simulator imports it, and neither
copies it.

Tokens: the text is split into pieces with `\w+|[^\w\s]` (runs of word characters, single punctuation characters;
whitespace is not a token); a piece of n characters is ceil(n / 6) tokens, its 6-character slices. So
"Hello, world!" is 4 tokens and "internationalization" is 4. Against a real BPE tokenizer this is within a few
tens of percent for English, well inside the slack of a threshold.

Chat template: each message is a `<|role|>` header line, its content and a newline; the prompt ends with
`<|assistant|>` and a newline. The system prompt and earlier turns therefore form a shared prefix.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

#: Characters per token slice of a long word run.
CHUNK_CHARS = 6

# Runs of word characters in slices of at most CHUNK_CHARS, or one other non-space character. Greedy `\w{1,6}`
# cuts a run of n word characters into exactly its ceil(n / 6) slices, in C instead of a Python loop.
_TOKEN_SLICES = re.compile(rf"\w{{1,{CHUNK_CHARS}}}|[^\w\s]")


def text_tokens(text: str) -> list[str]:
    """The approximate tokens of `text`, as strings (see the module docstring)."""
    return _TOKEN_SLICES.findall(text)


def chat_prompt(messages: Iterable[tuple[str, str]]) -> str:
    """The one prompt a list of (role, text content) pairs becomes under the shared chat template."""
    parts = [f"<|{role}|>\n{content}\n" for role, content in messages]
    parts.append("<|assistant|>\n")
    return "".join(parts)
