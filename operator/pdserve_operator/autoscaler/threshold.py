"""The disaggregation threshold as an output of the autoscaler (issue 19 item 2), within the user's bounds.

A prompt of at least the threshold's uncached tokens goes prefill -> decode; a shorter one is prefilled on decode
(chunked prefill there). Moving the threshold moves prompts between the pools within one tick, which a replica
count cannot do (a new pod takes a start-up): when prefill is short, decode can take the shortest of its prompts;
when decode's ITL is at risk, prefill can take them back. `decide_threshold` is pure, one step per tick:

1. Decode's ITL nears its target (its quantile above `target_fraction` of it): halve, down to the lower bound.
   Local prefills lengthen every decode step they join; fewer of them is the lever that acts at once.
2. Prefill is short (its engine TTFT over budget, the routers holding requests for a prefill engine with room, or
   its demand above what its ready replicas carry): double, up to the upper bound, if decode can take it. The
   charge comes from the capacity model's engine profile (the simulator's and vLLM's step shape): a step that
   carries a local prefill chunk of up to the new threshold (at most `max_num_batched_tokens`) lasts
   `prefill_per_token_s` longer per added token than with the current one; decode's ITL quantile plus that must
   stay within `target_fraction` of the ITL target. If not: hold (NoDecodeHeadroom).
3. Otherwise back toward the configured threshold one step (halve or double, never past it), with the same
   headroom check on the way up.

Decode's ITL unknown (no streamed tokens in the window, metrics missing): nothing is raised (the headroom is not
shown); lowering still happens, it is always safe for decode.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pdserve_operator.autoscaler.model import Estimates, ModelConfig
from pdserve_operator.autoscaler.signals import ServiceSignals

#: One step multiplies or divides the threshold by this.
STEP = 2


class ThresholdReason(enum.StrEnum):
    """Why the threshold has the value it has after a tick."""

    #: The configured value (the autoscaler has not moved it, or it came back).
    CONFIGURED = "Configured"
    PREFILL_SHORT = "PrefillShort"
    DECODE_ITL_AT_RISK = "DecodeItlAtRisk"
    #: Prefill is short, but decode's ITL has no room for longer local prefills.
    NO_DECODE_HEADROOM = "NoDecodeHeadroom"
    #: Back one step toward the configured value: the reason to move it is gone.
    RECOVERED = "Recovered"
    #: Away from the configured value, held there: the reason to move it remains, or going back is not safe yet.
    STEADY = "Steady"
    #: Decode's ITL is unknown: nothing is raised.
    METRICS_UNAVAILABLE = "MetricsUnavailable"


@dataclass(frozen=True, slots=True)
class ThresholdConfig:
    """The bounds the user set (`spec.autoscaling.disaggregationThreshold`) around the configured threshold."""

    #: spec.router.routing.disaggregationThreshold, clamped into [minimum, maximum]: where the threshold rests.
    base: int
    minimum: int
    maximum: int

    @classmethod
    def of(cls, configured: int, minimum: int, maximum: int) -> ThresholdConfig:
        """The configured value is kept inside the bounds (`EffectiveSpec.disaggregation_threshold_bounds`)."""
        return cls(base=max(minimum, min(maximum, configured)), minimum=minimum, maximum=maximum)

    @property
    def adaptive(self) -> bool:
        """Whether the bounds leave the autoscaler anything to choose."""
        return self.minimum < self.maximum

    def clamp(self, tokens: int) -> int:
        return max(self.minimum, min(self.maximum, tokens))


@dataclass(frozen=True, slots=True)
class ThresholdDecision:
    """One tick's threshold: before, after, why."""

    current: int
    desired: int
    reason: ThresholdReason
    message: str

    @property
    def changed(self) -> bool:
        return self.desired != self.current

    def event(self) -> str | None:
        """The Event text of a change, None when the threshold stays."""
        if not self.changed:
            return None
        return f"Disaggregation threshold {self.current} -> {self.desired} tokens: {self.message}"


def decide_threshold(
    config: ThresholdConfig, current: int, model: ModelConfig, signals: ServiceSignals, estimates: Estimates
) -> ThresholdDecision:
    """One tick (module docstring)."""
    current = config.clamp(current)
    itl, target = estimates.decode.latency_s, model.slo.itl_s
    safe = target * model.target_fraction
    itl_text = "unknown" if itl is None else _ms(itl)
    if itl is not None and itl > safe and current > config.minimum:
        lower = max(config.minimum, current // STEP)
        return ThresholdDecision(
            current,
            lower,
            ThresholdReason.DECODE_ITL_AT_RISK,
            f"decode ITL p{model.slo.percentile} {itl_text} nears the {_ms(target)} target: prompts of "
            f"{lower}-{current - 1} tokens go through prefill again",
        )
    short = _prefill_short(signals, estimates)
    if short is not None and current < config.maximum:
        return _raise(config, current, min(config.maximum, current * STEP), model, itl=itl, why=short)
    if short is None and current != config.base:
        toward = max(config.base, current // STEP) if current > config.base else min(config.base, current * STEP)
        if toward < current:
            return ThresholdDecision(
                current,
                toward,
                ThresholdReason.RECOVERED if toward == config.base else ThresholdReason.STEADY,
                f"prefill has capacity again: back toward the configured {config.base} tokens",
            )
        return _raise(config, current, toward, model, itl=itl, why="decode's ITL has room again")
    if current == config.base:
        return ThresholdDecision(current, current, ThresholdReason.CONFIGURED, "the configured threshold")
    why = short if short is not None else "prefill has capacity"
    return ThresholdDecision(current, current, ThresholdReason.STEADY, f"{why}; decode ITL {itl_text}")


def local_prefill_cost_s(model: ModelConfig, current: int, proposed: int) -> float:
    """What a decode step gains when its local prefill chunk may grow from `current` to `proposed` tokens (chunked
    at the decode engine's batch budget): the ITL of every sequence in that step grows by as much."""
    profile = model.decode_profile
    budget = profile.max_num_batched_tokens
    return profile.prefill_per_token_s * max(0, min(proposed, budget) - min(current, budget))


def _raise(
    config: ThresholdConfig, current: int, proposed: int, model: ModelConfig, *, itl: float | None, why: str
) -> ThresholdDecision:
    target = model.slo.itl_s
    safe = target * model.target_fraction
    if itl is None:
        return ThresholdDecision(
            current,
            current,
            ThresholdReason.METRICS_UNAVAILABLE,
            f"{why}, but decode's ITL is unknown: its headroom for local prefills is not shown",
        )
    cost = local_prefill_cost_s(model, current, proposed)
    charged = f"decode ITL p{model.slo.percentile} {_ms(itl)} + {_ms(cost)} for local prefills of up to {proposed - 1}"
    if itl + cost > safe:
        return ThresholdDecision(
            current, current, ThresholdReason.NO_DECODE_HEADROOM, f"{why}; {charged} tokens would pass {_ms(safe)}"
        )
    if proposed == config.base:
        reason = ThresholdReason.RECOVERED
    else:
        reason = ThresholdReason.PREFILL_SHORT if proposed > config.base else ThresholdReason.STEADY
    return ThresholdDecision(current, proposed, reason, f"{why}; {charged} tokens stays within {_ms(safe)}")


def _prefill_short(signals: ServiceSignals, estimates: Estimates) -> str | None:
    """Why prefill is short of capacity now, None when it is not."""
    prefill = estimates.prefill
    held = signals.router.queued_prefill_requests or 0.0
    if held > 0:
        return f"{held:.0f} request(s) wait in the routers for a prefill engine with room"
    if prefill.breach and prefill.latency_s is not None:
        return f"prefill engine TTFT {_ms(prefill.latency_s)} > {_ms(prefill.target_s)} budget"
    ready = signals.prefill.ready
    if prefill.required is not None and prefill.demand is not None and prefill.required > max(ready, 0):
        return f"prefill demand {prefill.demand:.0f} tok/s needs {prefill.required:.1f} replicas, {ready} ready"
    return None


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"
