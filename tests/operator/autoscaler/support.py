"""What several autoscaler test modules build the same way."""

from __future__ import annotations

from pdserve_operator.autoscaler.core import Autoscaler, AutoscalerConfig
from pdserve_operator.autoscaler.model import ModelConfig, Slo
from pdserve_operator.autoscaler.policy import PolicyConfig, PoolBounds


def autoscaler(prefill: tuple[int, int], decode: tuple[int, int]) -> Autoscaler:
    """The autoscaler at its defaults (SLO TTFT 800 ms / ITL 40 ms, a 15 s tick and window, 60 s warm-up) with
    each pool's (min, max) replicas."""
    config = AutoscalerConfig(
        model=ModelConfig(slo=Slo(0.8, 0.04), interval_s=15.0),
        policy=PolicyConfig(prefill=PoolBounds(*prefill), decode=PoolBounds(*decode)),
        warmup_s=60.0,
        window_s=15.0,
    )
    return Autoscaler(config)
