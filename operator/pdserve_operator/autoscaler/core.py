"""The autoscaler of one PDService: model and policy with the state they carry from tick to tick.

`Autoscaler.step(signals) -> Decision` is the whole brain; it does no IO, so the operator's loop, the tests and
the benchmark drive the same object. `config_from_spec` reads its configuration from a PDService's effective spec
and the operator's timing flags (`--autoscaler-interval-seconds`, `--autoscaler-window-seconds`), which it is
handed: nothing here has a default of its own for either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from pdserve.api.defaults import EffectivePool, EffectiveSpec
from pdserve_operator.autoscaler.bounds import bounded
from pdserve_operator.autoscaler.decision import Decision, Reason
from pdserve_operator.autoscaler.model import H200_8B, EngineProfile, ModelConfig, ModelState, Slo, estimate
from pdserve_operator.autoscaler.policy import PolicyConfig, PolicyState, PoolBounds, decide
from pdserve_operator.autoscaler.signals import ServiceSignals
from pdserve_operator.autoscaler.threshold import ThresholdConfig, decide_threshold


@dataclass(frozen=True, slots=True)
class AutoscalerConfig:
    """Everything one service's autoscaler is configured with."""

    #: The capacity model's configuration; its `interval_s` is the time between ticks.
    model: ModelConfig
    policy: PolicyConfig
    #: Pods ready for less than this teach the capacity model nothing (the collector marks them unsettled):
    #: `spec.autoscaling.warmupSeconds`.
    warmup_s: float
    #: The Prometheus rate/quantile window (`--autoscaler-window-seconds`; by default one interval, so a jump in
    #: load shows in full at the next tick: a longer window hides half of it). Needs a scrape interval of at most
    #: a third of it.
    window_s: float
    #: The disaggregation threshold's bounds around the configured value (`threshold.py`; chosen each tick only
    #: when `adaptive`). None: fixed at the model's `disaggregation_threshold`.
    threshold: ThresholdConfig | None = None

    @property
    def threshold_limits(self) -> ThresholdConfig:
        """`threshold`, or the fixed bounds of the model's configured threshold."""
        if self.threshold is not None:
            return self.threshold
        fixed = self.model.disaggregation_threshold
        return ThresholdConfig.of(fixed, fixed, fixed)


class Autoscaler:
    """Model + policy + their state for one service."""

    def __init__(self, config: AutoscalerConfig, threshold: int | None = None) -> None:
        """`threshold`: the disaggregation threshold the routers use now (a previous leader's, from status);
        None: the configured one."""
        self.config = config
        self.model_state = ModelState()
        self.policy_state = PolicyState()
        self.last: Decision | None = None
        limits = config.threshold_limits
        self.threshold = limits.clamp(limits.base if threshold is None else threshold)

    def reconfigure(self, config: AutoscalerConfig) -> None:
        """Take a new configuration (the spec changed) and keep what was learned."""
        self.config = config

    def step(self, signals: ServiceSignals) -> Decision:
        """One tick: signals in (bounded to what the replicas can physically do: `bounds`), decision out; the
        learned capacity and the history move forward."""
        limits = self.config.threshold_limits
        model = replace(self.config.model, disaggregation_threshold=limits.clamp(self.threshold))
        signals = bounded(signals, model)
        model_state, estimates = estimate(model, self.model_state, signals)
        decision, policy_state = decide(
            self.config.policy, model.slo, self.policy_state, signals, estimates, horizon_s=model.horizon_s
        )
        if limits.adaptive:
            threshold = decide_threshold(limits, model.disaggregation_threshold, model, signals, estimates)
            decision = replace(decision, threshold=threshold)
            self.threshold = threshold.desired
        else:
            self.threshold = limits.base
        self.model_state, self.policy_state, self.last = model_state, policy_state, decision
        return decision


class NoSloTargetError(ValueError):
    """Autoscaling is on for a pool but no latency target applies to it."""


def config_from_spec(
    spec: EffectiveSpec,
    *,
    interval_s: float,
    window_s: float,
    prefill_profile: EngineProfile = H200_8B,
    decode_profile: EngineProfile = H200_8B,
) -> AutoscalerConfig:
    """The autoscaler configuration a PDService asks for, from its effective spec (the validation result's) and
    the operator's tick (`interval_s`) and query window (`window_s`)."""
    for role, name in (("prefill", "ttftMilliseconds"), ("decode", "itlMilliseconds")):
        pool = spec.pool(role)  # type: ignore[arg-type]
        if _bounds(pool).managed and pool.autoscaling.target_milliseconds is None:
            raise NoSloTargetError(
                f"spec.{role}.autoscaling is enabled but no target applies: set spec.slo.{name} or "
                f"spec.{role}.autoscaling.targetMilliseconds"
            )
    ratio = spec.autoscaling.prefill_to_decode_ratio
    model = ModelConfig(
        slo=Slo(
            ttft_s=_seconds(spec.prefill.autoscaling.target_milliseconds),
            itl_s=_seconds(spec.decode.autoscaling.target_milliseconds),
            percentile=spec.slo.percentile,
        ),
        interval_s=interval_s,
        prefill_profile=prefill_profile,
        decode_profile=decode_profile,
        disaggregation_threshold=spec.router.routing.disaggregation_threshold,
    )
    policy = PolicyConfig(
        prefill=_bounds(spec.prefill),
        decode=_bounds(spec.decode),
        ratio_min=ratio.min,
        ratio_max=ratio.max,
        max_gpus=spec.autoscaling.max_gpus,
        scale_down_window_s=float(spec.autoscaling.scale_down_stabilization_seconds),
        burst_memory_s=float(spec.autoscaling.burst_memory_seconds),
    )
    return AutoscalerConfig(
        model=model,
        policy=policy,
        warmup_s=float(spec.autoscaling.warmup_seconds),
        window_s=window_s,
        threshold=ThresholdConfig.of(*spec.disaggregation_threshold_bounds()),
    )


def _seconds(milliseconds: float | None) -> float:
    # A pool without a target is not scaled by pdserve (checked above); its target is never compared.
    return math.inf if milliseconds is None else milliseconds / 1000.0


def _bounds(pool: EffectivePool) -> PoolBounds:
    scaling = pool.autoscaling
    gpus = max(pool.gpus_per_pod, 1)
    if not scaling.enabled:
        return PoolBounds(gpus_per_replica=gpus, managed=False, unmanaged_reason=Reason.DISABLED)
    if scaling.mode == "external":
        return PoolBounds(
            scaling.min_replicas, scaling.max_replicas, gpus, managed=False, unmanaged_reason=Reason.EXTERNAL
        )
    return PoolBounds(scaling.min_replicas, scaling.max_replicas, gpus)
