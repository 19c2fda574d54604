"""The autoscaler of one PDService: model and policy with the state they carry from tick to tick.

`Autoscaler.step(signals) -> Decision` is the whole brain; it does no IO, so the operator's loop (phase 2),
the tests and the benchmark drive the same object. `config_from_spec` reads its configuration from a PDService.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.api import defaults
from pdserve.api.v1alpha1 import PDService, PoolSpec
from pdserve_operator.autoscaler.decision import Decision, Reason
from pdserve_operator.autoscaler.model import H200_8B, EngineProfile, ModelConfig, ModelState, Slo, estimate
from pdserve_operator.autoscaler.policy import PolicyConfig, PolicyState, PoolBounds, decide
from pdserve_operator.autoscaler.signals import ServiceSignals


@dataclass(frozen=True, slots=True)
class AutoscalerConfig:
    """Everything one service's autoscaler is configured with."""

    model: ModelConfig
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    #: Pods ready for less than this teach the capacity model nothing (the collector marks them unsettled).
    warmup_s: float = float(defaults.AUTOSCALING_WARMUP_SECONDS)
    #: Seconds between ticks.
    interval_s: float = 15.0
    #: The Prometheus rate/quantile window: one interval, so a jump in load shows in full at the next tick
    #: (a longer window hides half of it). Needs a scrape interval of at most a third of it (5 s).
    window_s: float = 15.0


class Autoscaler:
    """Model + policy + their state for one service."""

    def __init__(self, config: AutoscalerConfig) -> None:
        self.config = config
        self.model_state = ModelState()
        self.policy_state = PolicyState()
        self.last: Decision | None = None

    def reconfigure(self, config: AutoscalerConfig) -> None:
        """Take a new configuration (the spec changed) and keep what was learned."""
        self.config = config

    def step(self, signals: ServiceSignals) -> Decision:
        """One tick: signals in, decision out; the learned capacity and the history move forward."""
        model_state, estimates = estimate(self.config.model, self.model_state, signals)
        decision, policy_state = decide(
            self.config.policy, self.config.model.slo, self.policy_state, signals, estimates
        )
        self.model_state, self.policy_state, self.last = model_state, policy_state, decision
        return decision


class NoSloTargetError(ValueError):
    """Autoscaling is on for a pool but no latency target applies to it."""


def config_from_spec(
    pds: PDService,
    prefill_profile: EngineProfile = H200_8B,
    decode_profile: EngineProfile = H200_8B,
) -> AutoscalerConfig:
    """The autoscaler configuration a PDService asks for (defaults from `pdserve.api.defaults`)."""
    spec = pds.spec
    slo = spec.slo
    percentile = (slo.percentile if slo else None) or defaults.SLO_PERCENTILE
    ttft_ms = _target(spec.prefill, slo.ttft_milliseconds if slo else None)
    itl_ms = _target(spec.decode, slo.itl_milliseconds if slo else None)
    for role, pool, target, name in (
        ("prefill", spec.prefill, ttft_ms, "ttftMilliseconds"),
        ("decode", spec.decode, itl_ms, "itlMilliseconds"),
    ):
        if _bounds(pool).managed and target is None:
            raise NoSloTargetError(
                f"spec.{role}.autoscaling is enabled but no target applies: set spec.slo.{name} or "
                f"spec.{role}.autoscaling.targetMilliseconds"
            )
    service = spec.autoscaling
    ratio = service.prefill_to_decode_ratio if service else None
    window = (
        service.scale_down_stabilization_seconds
        if service and service.scale_down_stabilization_seconds is not None
        else defaults.AUTOSCALING_SCALE_DOWN_STABILIZATION_SECONDS
    )
    warmup = (
        service.warmup_seconds
        if service and service.warmup_seconds is not None
        else defaults.AUTOSCALING_WARMUP_SECONDS
    )
    model = ModelConfig(
        slo=Slo(
            ttft_s=(ttft_ms or 0.0) / 1000.0 or float("inf"),
            itl_s=(itl_ms or 0.0) / 1000.0 or float("inf"),
            percentile=percentile,
        ),
        prefill_profile=prefill_profile,
        decode_profile=decode_profile,
        disaggregation_threshold=_threshold(pds),
    )
    policy = PolicyConfig(
        prefill=_bounds(spec.prefill),
        decode=_bounds(spec.decode),
        ratio_min=ratio.min if ratio else None,
        ratio_max=ratio.max if ratio else None,
        max_gpus=service.max_gpus if service else None,
        scale_down_window_s=float(window),
    )
    return AutoscalerConfig(model=model, policy=policy, warmup_s=float(warmup))


def _target(pool: PoolSpec, service_ms: float | None) -> float | None:
    scaling = pool.autoscaling
    if scaling is not None and scaling.target_milliseconds is not None:
        return scaling.target_milliseconds
    return service_ms


def _bounds(pool: PoolSpec) -> PoolBounds:
    scaling = pool.autoscaling
    gpus = max(pool.effective_gpus(), 1)
    if scaling is None or not scaling.enabled:
        return PoolBounds(gpus_per_replica=gpus, managed=False, unmanaged_reason=Reason.DISABLED)
    low = defaults.AUTOSCALING_MIN if scaling.min_replicas is None else scaling.min_replicas
    high = defaults.AUTOSCALING_MAX if scaling.max_replicas is None else scaling.max_replicas
    mode = scaling.mode or defaults.AUTOSCALING_MODE
    if mode == "external":
        return PoolBounds(low, high, gpus, managed=False, unmanaged_reason=Reason.EXTERNAL)
    return PoolBounds(low, high, gpus)


def _threshold(pds: PDService) -> int:
    router = pds.spec.router
    routing = router.routing if router else None
    value = routing.disaggregation_threshold if routing else None
    return defaults.DISAGGREGATION_THRESHOLD if value is None else value
