"""The scheduler: builds the decode and prefill profiles from the typed config and plans each request.

Default profiles and why:

- decode: available -> kv-compat with the peer (only on retries that reuse a prefill's KV) -> scores
  `decodeLoadWeight` x least in-flight requests + `decodePrefixWeight` x prefix affinity + 0.5 x KV-cache
  headroom (engine-reported, when scraping is on) -> max. Load first because decode engines are where every
  stream's inter-token latency lives; prefix affinity equally, because a decode-only request that hits the
  engine's cache skips its prefill entirely; KV headroom at half weight as a guard against engines the router's
  own counts misjudge (long contexts, other routers), without letting a lagging metric dominate.
- prefill: available -> kv-compat with the chosen decode -> scores `prefillPrefixWeight` x prefix affinity +
  `prefillLoadWeight` x least in-flight prefill tokens + `prefillTopologyWeight` x same topology domain -> max.
  Prefill time is dominated by uncached tokens, so the engine holding the prefix usually wins unless it is much
  busier; topology is a tie-breaker-plus (half weight) since a cross-zone transfer costs less than a recompute.

What an engine holds of a prompt comes from its KV events when it publishes them (`kvhub`: the same answer on
every router replica), else from this router's own record of what it sent where (`prefix.PrefixTracker`).

Keeping a cached prompt where it is: the scored decode pick weighs prefix affinity against load, and load is
min-max normalised, so one request more in flight can outweigh an engine holding the whole prompt. When the pick
would need the PD route (a full prefill on a prefill engine plus a KV transfer) while another decode engine holds
enough of the prompt to serve it without one, that engine is taken instead, as long as it is not much busier
(`HOLDER_LOAD_FACTOR` times the pick's in-flight requests, or `HOLDER_LOAD_SLACK` more). A prefill costs far more
than a few more streams on a decode engine; the bound keeps a popular prefix from piling every request onto one
engine. This matters most with several router replicas: each sees only its own share of the in-flight requests, so
its load differences are small numbers that min-max normalisation turns into full-weight preferences.

Planning order: pick decode first (it is the scarce, latency-critical side), decide whether the tokens it would
have to compute reach the threshold (`tokens.uncached_tokens`: exact under the shared prompt model, at a cost
bounded by the threshold rather than the prompt's length), then pick a prefill engine that pairs with it. If PD
is wanted and the chosen decode engine has no compatible prefill partner (mid-rollout), the decode pick is redone
among engines that do have one before falling back.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from pdserve.api.router_config import RoutingPolicyConfig
from pdserve_runtime.router.endpoints import EndpointState, EndpointTable
from pdserve_runtime.router.kvhub import KvEventsHub
from pdserve_runtime.router.policy.base import PickContext, Profile, WeightedScorer
from pdserve_runtime.router.policy.decision import Route
from pdserve_runtime.router.policy.filter_available import AvailableFilter
from pdserve_runtime.router.policy.filter_kv_compat import KvCompatFilter
from pdserve_runtime.router.policy.picker_max import MaxScorePicker
from pdserve_runtime.router.policy.scorer_kv_usage import KvCacheHeadroomScorer
from pdserve_runtime.router.policy.scorer_load import LeastLoadScorer, in_flight_requests, in_flight_tokens
from pdserve_runtime.router.policy.scorer_prefix import PrefixAffinityScorer
from pdserve_runtime.router.policy.scorer_topology import SameTopologyScorer
from pdserve_runtime.router.prefix import PrefixTracker
from pdserve_runtime.router.tiers import STORE, TierWeights
from pdserve_runtime.router.tokens import Held, PromptInfo, Uncached, uncached_tokens


@dataclass(frozen=True, slots=True)
class Plan:
    """The routing decision for one request (before any failure changes it)."""

    route: Route
    decode: EndpointState | None
    prefill: EndpointState | None
    uncached_tokens: int
    held: Mapping[str, Held]


# A decode engine holding the prompt is taken instead of the scored pick (which would need a prefill) while its
# in-flight requests are at most this factor of the pick's, or this many more.
HOLDER_LOAD_FACTOR = 2
HOLDER_LOAD_SLACK = 4

# How old an engine-reported KV-cache usage reading may be before the headroom scorer ignores it.
KV_USAGE_STALE_SECONDS = 10.0


def tier_weights(policy: RoutingPolicyConfig) -> TierWeights:
    """What a prefix is worth per tier: the store only counts when the service has one."""
    return TierWeights(cpu=policy.cpu_tier_weight, store=policy.store_tier_weight if policy.kv_store else 0.0)


def decode_profile(policy: RoutingPolicyConfig, rng: random.Random | None = None) -> Profile:
    return Profile(
        filters=(AvailableFilter(), KvCompatFilter()),
        scorers=(
            WeightedScorer(LeastLoadScorer(in_flight_requests), policy.decode_load_weight),
            WeightedScorer(
                PrefixAffinityScorer(tier_weights(policy)), policy.decode_prefix_weight if policy.prefix_aware else 0.0
            ),
            WeightedScorer(KvCacheHeadroomScorer(stale_after=KV_USAGE_STALE_SECONDS), policy.kv_headroom_weight),
        ),
        picker=MaxScorePicker(rng),
    )


def prefill_profile(
    policy: RoutingPolicyConfig, topology_labels: Sequence[str], rng: random.Random | None = None
) -> Profile:
    return Profile(
        filters=(AvailableFilter(), KvCompatFilter()),
        scorers=(
            WeightedScorer(
                PrefixAffinityScorer(tier_weights(policy)), policy.prefill_prefix_weight if policy.prefix_aware else 0.0
            ),
            WeightedScorer(LeastLoadScorer(in_flight_tokens), policy.prefill_load_weight),
            WeightedScorer(SameTopologyScorer(topology_labels), policy.prefill_topology_weight),
        ),
        picker=MaxScorePicker(rng),
    )


class Scheduler:
    """Plans requests over the live endpoint table."""

    def __init__(
        self,
        table: EndpointTable,
        tracker: PrefixTracker,
        policy: RoutingPolicyConfig,
        topology_labels: Sequence[str] = (),
        rng: random.Random | None = None,
        *,
        kv: KvEventsHub | None = None,
    ) -> None:
        self.table = table
        self.tracker = tracker
        self.kv = kv
        self.policy = policy
        # The disaggregation threshold in use: the policy's, until the operator publishes another (`control`).
        self.threshold = policy.disaggregation_threshold_tokens
        self._decode = decode_profile(policy, rng)
        self._prefill = prefill_profile(policy, topology_labels, rng)

    def held_by(self, prompt: PromptInfo, now: float) -> Mapping[str, Held]:
        """What each engine is believed to hold of the prompt (nothing when prefix awareness is off)."""
        if not self.policy.prefix_aware or prompt.size <= 1:
            return {}
        held = self.tracker.match(prompt.key, now)
        if self.kv is not None:
            # Engines that publish KV events: what their events say replaces the tracker's guess (kvhub).
            self.kv.refine(prompt, held)
        return held

    def pick_decode(
        self,
        prompt: PromptInfo,
        held: Mapping[str, Held],
        *,
        excluded: Collection[str] = (),
        peer: EndpointState | None = None,
        candidates: Sequence[EndpointState] | None = None,
    ) -> EndpointState | None:
        ctx = PickContext(prompt=prompt, held=held, peer=peer, excluded=excluded)
        return self._decode.pick(ctx, self.table.states("decode") if candidates is None else candidates)

    def pick_prefill(
        self,
        prompt: PromptInfo,
        held: Mapping[str, Held],
        decode: EndpointState,
        *,
        excluded: Collection[str] = (),
        candidates: Sequence[EndpointState] | None = None,
    ) -> EndpointState | None:
        ctx = PickContext(prompt=prompt, held=held, peer=decode, excluded=excluded)
        return self._prefill.pick(ctx, self.table.states("prefill") if candidates is None else candidates)

    def _holder_instead(
        self,
        prompt: PromptInfo,
        held: Mapping[str, Held],
        chosen: EndpointState,
        threshold: int,
        candidates: Sequence[EndpointState] | None = None,
    ) -> tuple[EndpointState, Uncached] | None:
        """A decode engine holding enough of the prompt to skip prefill, when the scored pick would need it and the
        holder is not much busier (module docstring, "Keeping a cached prompt where it is")."""
        bound = max(chosen.in_flight * HOLDER_LOAD_FACTOR, chosen.in_flight + HOLDER_LOAD_SLACK)
        best: tuple[EndpointState, Uncached] | None = None
        for state in self.table.states("decode") if candidates is None else candidates:
            entry = held.get(state.url)
            if state is chosen or entry is None or not state.usable or state.in_flight > bound:
                continue
            found = uncached_tokens(prompt, entry, threshold)
            if not found.wants_prefill and (best is None or state.in_flight < best[0].in_flight):
                best = (state, found)
        return best

    def _loadable(self, held: Mapping[str, Held], decode: EndpointState) -> Held | None:
        """What the decode engine would not compute: its own prefix, or the store's when that is longer (it loads
        it from the store instead of computing it)."""
        own, stored = held.get(decode.url), held.get(STORE) if self.policy.kv_store else None
        if stored is None or (own is not None and own.common >= stored.common):
            return own
        return stored

    def plan(self, prompt: PromptInfo, now: float, decode_candidates: Sequence[EndpointState] | None = None) -> Plan:
        """Choose the decode engine, the route and (for PD) the prefill engine.

        `decode_candidates`: the decode engines the request may go to (default: the whole pool); a gateway's
        endpoint subset narrows it (`pdserve_runtime.gateway`).
        """
        held = self.held_by(prompt, now)
        threshold = self.threshold
        decode = self.pick_decode(prompt, held, candidates=decode_candidates)
        if decode is None:
            return Plan(Route.DECODE_ONLY, None, None, 0, held)
        uncached = uncached_tokens(prompt, self._loadable(held, decode), threshold)
        if uncached.wants_prefill and held:
            holder = self._holder_instead(prompt, held, decode, threshold, decode_candidates)
            if holder is not None:
                decode, uncached = holder
        if not uncached.wants_prefill:
            return Plan(Route.DECODE_ONLY, decode, None, uncached.tokens, held)
        prefill = self.pick_prefill(prompt, held, decode)
        if prefill is None:
            # Mid-rollout the chosen decode engine may have no compatible prefill engine while others do.
            compat = {state.endpoint.kv_compat for state in self.table.usable("prefill")}
            pool = self.table.states("decode") if decode_candidates is None else decode_candidates
            pairable = [state for state in pool if state.endpoint.kv_compat in compat]
            alternative = self.pick_decode(prompt, held, candidates=pairable) if pairable else None
            if alternative is not None:
                decode = alternative
                uncached = uncached_tokens(prompt, self._loadable(held, decode), threshold)
                prefill = self.pick_prefill(prompt, held, decode)
        if prefill is None:
            return Plan(Route.FALLBACK, decode, None, uncached.tokens, held)
        return Plan(Route.PD, decode, prefill, uncached.tokens, held)
