"""The scaling policies the benchmark compares, each reading only what it would read in production.

- `static-peak`: a fixed allocation sized for the trace's busiest window with the engine profile's capacity at
  the SLO (`static_peak`), the way an operator without an autoscaler provisions.
- `hpa-style`: Kubernetes' HPA on a utilisation metric per pool, with HPA's default behaviour: desired =
  ceil(ready x utilisation / target) (not-ready pods count as idle on the way up and as at-target on the way
  down), a 10% tolerance, scale-up without stabilization limited to max(+100%, +4 pods) per 15 s, scale-down
  to the highest recommendation of the last 300 s, at most -100% per 15 s. Utilisation: prefill the engine's
  busy share (what DCGM's GPU utilisation reports), decode running sequences over max_num_seqs (GPU
  utilisation reads ~100% whenever decode has any work); target 70%.
- `llm-d-slo`: llm-d's SLO-aware KEDA law as published (llm-d docs, architecture/autoscaling/slo-aware-keda):
  s = the 45 s average of min(p90 latency / target, 2); above 0.55 the pool grows to
  n + ceil(n (s c / 0.55 - 1)) with the in-flight credit c = ready / provisioned; below 0.40 it shrinks to
  n - floor(n (1 - s / 0.40)); in between it holds; then the HPA behaviour of that guide: scale-up by at
  most max(100%, 4 pods) per 60 s after a 30 s stabilization window, scale-down by 1 pod per 120 s after a
  180 s window. llm-d scales one pool per law; for PD each pool gets its own: TTFT for prefill, TPOT for
  decode (no attribution: a TTFT breach scales prefill whatever caused it).
- `pdserve`: the product's `Autoscaler` (model + policy), fed the signals the collector would read.
- `dynamo-planner`: NVIDIA Dynamo's SLA planner, in its own module (`pdserve_dev.replay.dynamo`).

All policies share the replay's min/max bounds and control interval.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve_dev.replay.observe import Observation
from pdserve_dev.replay.trace import Request, windows
from pdserve_operator.autoscaler.core import Autoscaler, AutoscalerConfig
from pdserve_operator.autoscaler.decision import Decision
from pdserve_operator.autoscaler.model import EngineProfile, ModelConfig, ModelState, estimate
from pdserve_operator.autoscaler.policy import PolicyConfig
from pdserve_operator.autoscaler.signals import PoolSignals, Role, ServiceSignals
from pdserve_sim.presets import TimingParams

ROLES: tuple[Role, Role] = ("prefill", "decode")


def profile_from_timing(timing: TimingParams) -> EngineProfile:
    """The autoscaler's engine profile of a simulator timing preset (the same cost model)."""
    return EngineProfile(
        step_overhead_s=timing.step_overhead,
        prefill_fixed_s=timing.prefill_fixed,
        prefill_per_token_s=timing.prefill_per_token,
        decode_per_seq_s=timing.decode_per_seq,
        decode_per_context_token_s=timing.decode_per_context_token,
        max_num_batched_tokens=timing.max_num_batched_tokens,
        max_num_seqs=timing.max_num_seqs,
        kv_cache_tokens=timing.num_kv_blocks * timing.block_size,
        kv_bytes_per_token=timing.kv_model_bytes_per_token,
        kv_link_bytes_per_s=timing.kv_link_bytes_per_second,
    )


class StaticScaler:
    """Never changes anything."""

    def __init__(self, prefill: int, decode: int, name: str = "static-peak") -> None:
        self.name = name
        self.size = (prefill, decode)

    def tick(self, observation: Observation) -> tuple[int, int]:
        return self.size


@dataclass(frozen=True, slots=True)
class HpaBehavior:
    """An HPA `behavior` block: stabilization windows and rate policies (max of percent and pods per period)."""

    up_window_s: float = 0.0
    up_percent: float = 100.0
    up_pods: int = 4
    up_period_s: float = 15.0
    down_window_s: float = 300.0
    down_percent: float = 100.0
    down_pods: int = 0
    down_period_s: float = 15.0


@dataclass(slots=True)
class _HpaState:
    """One pool's HPA memory: recent recommendations and recent replica changes."""

    behavior: HpaBehavior
    recommendations: list[tuple[float, int]] = field(default_factory=list)
    changes: list[tuple[float, int]] = field(default_factory=list)

    def desired(self, at: float, recommendation: int, current: int) -> int:
        """Stabilize, then rate-limit, as the HPA controller does (stabilizeRecommendationWithBehaviors and
        convertDesiredReplicasWithBehaviorRate)."""
        b = self.behavior
        keep = max(b.up_window_s, b.down_window_s, b.up_period_s, b.down_period_s)
        self.recommendations = [(t, n) for t, n in self.recommendations if t > at - keep]
        self.recommendations.append((at, recommendation))
        up = min(n for t, n in self.recommendations if t > at - b.up_window_s - 1e-9)
        down = max(n for t, n in self.recommendations if t > at - b.down_window_s - 1e-9)
        desired = current
        if current < up:
            desired = up
        elif current > down:
            desired = down
        self.changes = [(t, d) for t, d in self.changes if t > at - keep]
        if desired > current:
            added = sum(d for t, d in self.changes if d > 0 and t > at - b.up_period_s)
            start = current - added
            limit = max(math.ceil(start * (1 + b.up_percent / 100)), start + b.up_pods)
            desired = min(desired, max(limit, current))
        elif desired < current:
            removed = -sum(d for t, d in self.changes if d < 0 and t > at - b.down_period_s)
            start = current + removed
            limit = min(math.floor(start * (1 - b.down_percent / 100)), start - b.down_pods)
            desired = max(desired, min(limit, current))
        if desired != current:
            self.changes.append((at, desired - current))
        return desired


class HpaScaler:
    """HPA on a utilisation metric (module docstring)."""

    def __init__(
        self, policy: PolicyConfig, *, target: float = 0.7, tolerance: float = 0.1, behavior: HpaBehavior | None = None
    ) -> None:
        self.name = "hpa-style"
        self.policy = policy
        self.target = target
        self.tolerance = tolerance
        self._state = {role: _HpaState(behavior or HpaBehavior()) for role in ROLES}

    def tick(self, observation: Observation) -> tuple[int, int]:
        out: list[int] = []
        for role in ROLES:
            pool = observation.signals.pool(role)
            current = pool.desired
            utilisation = observation.utilisation[role]
            bounds = self.policy.bounds(role)
            if utilisation is None or pool.ready == 0:
                out.append(bounds.clamp(current))
                continue
            ratio = utilisation / self.target
            starting = current - pool.ready
            if abs(ratio - 1.0) <= self.tolerance:
                recommendation = current
            elif ratio > 1.0:
                # Not-ready pods count as idle on the way up; never a scale-down from an upward signal.
                recommendation = max(current, math.ceil(pool.ready * ratio))
            else:
                # ...and as at-target on the way down; never a scale-up from a downward signal.
                recommendation = min(current, math.ceil(pool.ready * ratio + starting))
            recommendation = bounds.clamp(recommendation)
            out.append(bounds.clamp(self._state[role].desired(observation.at, recommendation, current)))
        return out[0], out[1]


#: The HPA behaviour of llm-d's SLO-aware guide.
LLMD_BEHAVIOR = HpaBehavior(
    up_window_s=30.0,
    up_percent=100.0,
    up_pods=4,
    up_period_s=60.0,
    down_window_s=180.0,
    down_percent=0.0,
    down_pods=1,
    down_period_s=120.0,
)


class LlmdSloScaler:
    """llm-d's SLO-aware law (module docstring)."""

    def __init__(
        self,
        policy: PolicyConfig,
        ttft_s: float,
        itl_s: float,
        *,
        up: float = 0.55,
        down: float = 0.40,
        clamp: float = 2.0,
        smoothing_s: float = 45.0,
    ) -> None:
        self.name = "llm-d-slo"
        self.policy = policy
        self.targets = {"prefill": ttft_s, "decode": itl_s}
        self.up = up
        self.down = down
        self.clamp = clamp
        self.smoothing_s = smoothing_s
        self._samples: dict[Role, list[tuple[float, float]]] = {role: [] for role in ROLES}
        self._state = {role: _HpaState(LLMD_BEHAVIOR) for role in ROLES}

    def tick(self, observation: Observation) -> tuple[int, int]:
        out: list[int] = []
        for role in ROLES:
            pool = observation.signals.pool(role)
            n, ready = pool.desired, pool.ready
            bounds = self.policy.bounds(role)
            latency = observation.ttft_p90 if role == "prefill" else observation.itl_p90
            # No traffic reads 0 (the guide's NaN -> 0).
            raw = 0.0 if latency is None else min(latency / self.targets[role], self.clamp)
            samples = [(t, v) for t, v in self._samples[role] if t > observation.at - self.smoothing_s]
            samples.append((observation.at, raw))
            self._samples[role] = samples
            s = sum(v for _, v in samples) / len(samples)
            credit = ready / n if 0 < ready < n else 1.0
            if s > self.up:
                wanted = n + math.ceil(n * (s * credit / self.up - 1.0))
            elif s < self.down:
                wanted = n - math.floor(n * (1.0 - s / self.down))
            else:
                wanted = n
            wanted = bounds.clamp(wanted)
            out.append(bounds.clamp(self._state[role].desired(observation.at, wanted, n)))
        return out[0], out[1]


class PdserveScaler:
    """The product's autoscaler."""

    def __init__(self, config: AutoscalerConfig) -> None:
        self.name = "pdserve"
        self.autoscaler = Autoscaler(config)
        self.decisions: list[Decision] = []

    @property
    def threshold(self) -> int:
        """The disaggregation threshold it publishes (the configured one unless its config has bounds)."""
        return self.autoscaler.threshold

    def tick(self, observation: Observation) -> tuple[int, int]:
        decision = self.autoscaler.step(observation.signals)
        if decision.actions() or (decision.threshold is not None and decision.threshold.changed):
            self.decisions.append(decision)
        return decision.prefill.desired, decision.decode.desired


def static_peak(
    model: ModelConfig, requests: Sequence[Request], window_s: float, threshold: int
) -> tuple[int, int, float]:
    """Replicas per pool for the trace's busiest window, by the profile's capacity at the SLO; and the peak
    window's start (s). Uses the autoscaler's own model on the window's demand, with nothing learned."""
    best = (1, 1)
    peak_at = 0.0
    long_prompts = [r for r in requests if r.prompt >= threshold]
    short_prompts = [r for r in requests if r.prompt < threshold]
    by_window_long = windows(long_prompts, window_s, model.slo.percentile)
    by_window_all = windows(requests, window_s, model.slo.percentile)
    by_window_short = windows(short_prompts, window_s, model.slo.percentile)
    for index, demand in enumerate(by_window_all):
        long = by_window_long[index] if index < len(by_window_long) else None
        short = by_window_short[index] if index < len(by_window_short) else None
        signals = ServiceSignals(
            at=demand.start_s,
            window_s=window_s,
            percentile=model.slo.percentile,
            prefill=PoolSignals(
                role="prefill",
                desired=1,
                ready=1,
                request_rate=long.requests_per_s if long else 0.0,
                prompt_tokens_rate=long.prompt_tokens_per_s if long else 0.0,
                uncached_tokens_rate=long.prompt_tokens_per_s if long else 0.0,
                prompt_tokens_quantile=long.prompt_tokens_quantile if long else None,
                waiting=0.0,
                completeness=1.0,
                freshness_s=0.0,
            ),
            decode=PoolSignals(
                role="decode",
                desired=1,
                ready=1,
                request_rate=demand.requests_per_s,
                prompt_tokens_rate=demand.prompt_tokens_per_s,
                uncached_tokens_rate=short.prompt_tokens_per_s if short else 0.0,
                generated_tokens_rate=demand.output_tokens_per_s,
                waiting_capacity=0.0,
                completeness=1.0,
                freshness_s=0.0,
            ),
        )
        _, estimates = estimate(model, ModelState(), signals)
        sizes = tuple(max(1, math.ceil((estimates.pool(role).required or 0.0) - 1e-9)) for role in ROLES)
        if sizes[0] + sizes[1] > best[0] + best[1]:
            peak_at = demand.start_s
        best = (max(best[0], sizes[0]), max(best[1], sizes[1]))
    return best[0], best[1], peak_at
