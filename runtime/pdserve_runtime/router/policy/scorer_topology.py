"""Scorer: prefer endpoints in the peer's topology domain (same zone, rack or node as the decode engine).

KV moves from prefill to decode over the network; staying inside a rack or zone keeps that transfer on the
fastest links. Score = the fraction of the configured topology labels (in `topology_labels`) on which the
candidate and the peer both have a value and the values agree. Without a peer, or without labels, all score 0.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve_runtime.router.endpoints import EndpointState
from pdserve_runtime.router.policy.base import PickContext


class SameTopologyScorer:
    def __init__(self, labels: Sequence[str]) -> None:
        self._labels = tuple(labels)

    def score(self, ctx: PickContext, candidates: Sequence[EndpointState]) -> list[float]:
        if ctx.peer is None or not self._labels:
            return [0.0] * len(candidates)
        peer = ctx.peer.endpoint.topology
        wanted = {label: peer[label] for label in self._labels if peer.get(label)}
        if not wanted:
            return [0.0] * len(candidates)
        scale = 1.0 / len(self._labels)
        return [
            scale * sum(1 for label, value in wanted.items() if state.endpoint.topology.get(label) == value)
            for state in candidates
        ]
