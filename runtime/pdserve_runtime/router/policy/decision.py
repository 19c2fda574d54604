"""Selective disaggregation: does this request go through a prefill engine at all?

Disaggregation pays a fixed cost (an extra HTTP round trip to prefill, then a KV transfer) to take prefill work
off the decode engine, where long prefills would stall every running stream's next token. That trade only pays
for prompts with a lot of *uncached* work: a short prompt, or a long one whose prefix the decode engine already
holds, is cheaper to prefill locally on the decode engine.

So: uncached = prompt tokens the chosen decode engine would compute, given what it is believed to hold (prefix
tracker; the arithmetic is `tokens.uncached_tokens`). At or above `threshold` the request goes prefill -> decode
("pd"), below it straight to decode ("decode-only"). When PD is
wanted but no prefill engine can take it, "fallback" sends it to decode anyway if the configuration allows;
otherwise the request is refused (503), which protects decode engines from long prefills by policy.
"""

from __future__ import annotations

from enum import StrEnum


class Route(StrEnum):
    PD = "pd"
    DECODE_ONLY = "decode-only"
    FALLBACK = "fallback"
