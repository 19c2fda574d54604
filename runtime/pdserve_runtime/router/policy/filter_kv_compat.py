"""Filter: only endpoints whose KV-compatibility value equals the peer's.

The value is the engines' `pdserve.io/kv-compat` pod label, a hash of everything that must match for a NIXL
transfer to work (model, dtype, TP layout, block size), as the router sees it on the engine's EndpointSlice (the
operator's per-value Service selects only pods carrying it; see discovery.kubernetes). During a rollout old and
new engines coexist; pairing them would fail at the KV handshake, so they are never paired. Without a peer (the
first pick of a request) every candidate passes. Static mode has no labels: None equals None, so everything pairs.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve_runtime.router.endpoints import EndpointState
from pdserve_runtime.router.policy.base import PickContext


class KvCompatFilter:
    def filter(self, ctx: PickContext, candidates: Sequence[EndpointState]) -> list[EndpointState]:
        if ctx.peer is None:
            return list(candidates)
        wanted = ctx.peer.endpoint.kv_compat
        return [state for state in candidates if state.endpoint.kv_compat == wanted]
