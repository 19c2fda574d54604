"""The autoscaler's configuration from a PDService, and one service's autoscaler over ticks."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from pdserve.api.defaults import effective
from pdserve.api.settings import OperatorSettings
from pdserve.api.v1alpha1 import PDService
from pdserve_operator.autoscaler.actuator import pod_states
from pdserve_operator.autoscaler.core import Autoscaler, AutoscalerConfig, NoSloTargetError, config_from_spec
from pdserve_operator.autoscaler.decision import Reason
from pdserve_operator.autoscaler.signals import PodPhase, PodState, PoolSignals, ServiceSignals, count_pods


def service(**spec: Any) -> PDService:
    body: dict[str, Any] = {
        "model": {"name": "m", "uri": "hf://org/m"},
        "engine": {"image": "vllm/vllm-openai:v0.32.0"},
        "slo": {"ttftMilliseconds": 800, "itlMilliseconds": 40},
    }
    body.update(spec)
    return PDService.model_validate({"metadata": {"name": "svc"}, "spec": body})


INTERVAL_S = OperatorSettings.autoscaler_interval_seconds


def configure(pds: PDService, window_s: float = INTERVAL_S) -> AutoscalerConfig:
    """The configuration the operator's loop gives `pds`'s autoscaler, at the default tick."""
    return config_from_spec(effective(pds.spec), interval_s=INTERVAL_S, window_s=window_s)


def test_config_reads_bounds_targets_and_service_settings() -> None:
    pds = service(
        prefill={"tensorParallelSize": 2, "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 9}},
        decode={
            "tensorParallelSize": 2,
            "autoscaling": {"enabled": True, "maxReplicas": 12, "targetMilliseconds": 30},
        },
        slo={"ttftMilliseconds": 600, "itlMilliseconds": 50, "percentile": 95},
        autoscaling={
            "maxGpus": 32,
            "prefillToDecodeRatio": {"min": 0.25, "max": 2},
            "warmupSeconds": 90,
            "scaleDownStabilizationSeconds": 240,
            "burstMemorySeconds": 420,
        },
    )
    config = configure(pds)
    assert (config.model.slo.ttft_s, config.model.slo.itl_s, config.model.slo.percentile) == (0.6, 0.03, 95)
    assert (config.policy.prefill.min_replicas, config.policy.prefill.max_replicas) == (2, 9)
    assert (config.policy.decode.min_replicas, config.policy.decode.max_replicas) == (1, 12)
    assert config.policy.prefill.gpus_per_replica == 2
    assert (config.policy.ratio_min, config.policy.ratio_max, config.policy.max_gpus) == (0.25, 2, 32)
    assert (config.warmup_s, config.policy.scale_down_window_s) == (90.0, 240.0)
    assert config.policy.burst_memory_s == 420.0


def test_config_takes_the_tick_and_the_window_it_is_given() -> None:
    config = config_from_spec(
        effective(service(prefill={"autoscaling": {"enabled": True}}).spec), interval_s=7.0, window_s=21.0
    )
    assert (config.model.interval_s, config.window_s) == (7.0, 21.0)


def test_defaults_and_owners() -> None:
    pds = service(
        prefill={"autoscaling": {"enabled": True, "mode": "external"}},
        decode={"autoscaling": {"enabled": False}},
    )
    config = configure(pds)
    assert not config.policy.prefill.managed and config.policy.prefill.unmanaged_reason is Reason.EXTERNAL
    assert not config.policy.decode.managed and config.policy.decode.unmanaged_reason is Reason.DISABLED
    assert config.policy.scale_down_window_s == 180.0 and config.warmup_s == 60.0
    assert config.policy.burst_memory_s == 300.0
    assert config.policy.max_gpus is None and config.policy.ratio_min is None


def test_autoscaling_without_a_target_is_refused_with_the_fix() -> None:
    pds = service(slo=None, decode={"autoscaling": {"enabled": True}})
    with pytest.raises(NoSloTargetError, match=r"spec\.slo\.itlMilliseconds or spec\.decode\.autoscaling"):
        configure(pds)


def test_autoscaler_carries_state_between_ticks() -> None:
    pds = service(prefill={"autoscaling": {"enabled": True, "maxReplicas": 10}})
    autoscaler = Autoscaler(configure(pds))

    def tick(at: float, load: float, desired: int) -> ServiceSignals:
        pool = PoolSignals(
            role="prefill",
            desired=desired,
            ready=desired,
            request_rate=load / 1000,
            prompt_tokens_rate=load,
            uncached_tokens_rate=load,
            prompt_tokens_quantile=2000.0,
            waiting=0.0,
            freshness_s=1.0,
            completeness=1.0,
        )
        return ServiceSignals(at=at, window_s=15.0, percentile=90, prefill=pool, decode=PoolSignals("decode", 1))

    first = autoscaler.step(tick(0.0, 100_000.0, 2))
    assert first.prefill.desired > 2
    assert first.decode.reason is Reason.DISABLED
    assert autoscaler.model_state.prefill_demand.at == 0.0
    second = autoscaler.step(tick(15.0, 100_000.0, first.prefill.desired))
    assert second.prefill.desired == first.prefill.desired
    assert autoscaler.last is second


def test_count_pods_by_phase() -> None:
    pods = [
        PodState("a", "prefill", PodPhase.READY, 100.0),
        PodState("b", "prefill", PodPhase.STARTING),
        PodState("c", "prefill", PodPhase.PENDING),
        PodState("d", "prefill", PodPhase.TERMINATING),
        PodState("e", "decode", PodPhase.READY, 5.0),
    ]
    assert count_pods(pods, "prefill") == (1, 1, 1)
    assert count_pods(pods, "decode") == (1, 0, 0)


def _pod(name: str, role: str | None, **status: Any) -> dict[str, Any]:
    labels = {"pdserve.io/role": role} if role else {}
    pod: dict[str, Any] = {"metadata": {"name": name, "labels": labels}, "status": {"conditions": []}}
    for kind, (state, extra) in status.items():
        pod["status"]["conditions"].append({"type": kind, "status": state, **extra})
    return pod


def test_pod_states_from_pod_objects() -> None:
    now = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)
    terminating = _pod("p-3", "prefill", Ready=("True", {"lastTransitionTime": "2026-01-01T11:00:00Z"}))
    terminating["metadata"]["deletionTimestamp"] = "2026-01-01T11:59:59Z"
    pods = [
        _pod("p-0", "prefill", Ready=("True", {"lastTransitionTime": "2026-01-01T11:58:30Z"})),
        _pod("p-1", "prefill", PodScheduled=("False", {"reason": "Unschedulable"})),
        _pod("p-2", "prefill", PodScheduled=("True", {}), Ready=("False", {})),
        terminating,
        _pod("d-0", "decode", Ready=("True", {"lastTransitionTime": "2026-01-01T11:59:50Z"})),
        _pod("r-0", "router", Ready=("True", {})),
        _pod("other", None),
    ]
    states = {s.name: s for s in pod_states(pods, now)}
    assert set(states) == {"p-0", "p-1", "p-2", "p-3", "d-0"}
    assert (states["p-0"].phase, states["p-0"].ready_for_s) == (PodPhase.READY, 90.0)
    assert states["p-1"].phase is PodPhase.PENDING
    assert states["p-2"].phase is PodPhase.STARTING
    assert states["p-3"].phase is PodPhase.TERMINATING
    assert (states["d-0"].role, states["d-0"].ready_for_s) == ("decode", 10.0)
