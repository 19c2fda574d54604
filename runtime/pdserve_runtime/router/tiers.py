"""KV tiers in routing: where an engine holds a prompt's prefix, and what that is worth.

A prefix in an engine's GPU cache is reused for free; one in its CPU offload tier costs a copy back into GPU memory;
one in the shared KV store costs a transfer from the store, open to every engine. Each is worth less than the one
before and more than nothing (recomputing it), so the prefix scorer weighs an engine's held fraction by the tier it
is held in (`TierWeights`, from the routing policy).

Which tier an engine's prefix sits in comes from a `TierSource`. The one here, `TrackedTiers`, knows what the
router's own tracking can know: what an engine served sits in its GPU cache (the router cannot see an engine
offload blocks), and what a prefill engine computed while the service has a store sits in the store, under the
pseudo-engine `STORE` in the prefix tracker, held for every engine at once. vLLM's KV events carry each block's
medium; an index built from them provides the same interface with CPU tiers seen as they happen.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from pdserve_runtime.router.tokens import Held

STORE = "kvstore:"
"""The prefix tracker's key for what the shared KV store holds (not an engine URL: no engine is ever named so)."""


class Medium(StrEnum):
    """Where KV blocks are, in vLLM's KV event spelling (`BlockStored.medium`) where it has one."""

    GPU = "GPU"
    CPU = "CPU"
    STORE = "STORE"


@dataclass(frozen=True, slots=True)
class TierWeights:
    """What a held prefix is worth in each tier, relative to the GPU cache (1.0)."""

    cpu: float
    store: float

    def of(self, medium: Medium) -> float:
        if medium is Medium.GPU:
            return 1.0
        return self.cpu if medium is Medium.CPU else self.store


class TierSource(Protocol):
    """The tier of the prefix `held` that the engine at `url` (or `STORE`) holds."""

    def medium(self, url: str, held: Held) -> Medium: ...


class TrackedTiers:
    """The router's own tracking (module docstring): the store's entries are in the store, the rest in GPU memory."""

    def medium(self, url: str, held: Held) -> Medium:
        return Medium.STORE if url == STORE else Medium.GPU
