"""Input bounds (pure): every measured value the model reads, checked against what a replica set can physically do.

A series the collector reads may be broken (an exporter bug, a counter gone wrong, a Prometheus answering
garbage) or forged (a pod that is not the pool's: `pdserve_operator.ownership` keeps those out of the queries).
One absurd reading must not move a pool: the model's demand filter remembers a surprise for many ticks (it keeps
a reserve after a jump), so a single tick of 1e12 tokens/s once held a pool at maxReplicas for over an hour, and
values like 1e308 overflowed the arithmetic inside a tick. So before the model sees a tick's signals:

- every value that is not a finite number, or is negative, is not observed (None);
- every value beyond what the pool's replicas can physically do is not observed either, and the tick says which
  and why (`ServiceSignals.errors`): the policy then holds that pool (MetricsUnavailable) instead of acting on it,
  and the demand filter never sees the value. Not clamped: a value past the bound is not a large load, it is a
  wrong one, and clamping it would still be a jump to the bound.

What a replica can do comes from the engine profile the model itself uses (`EngineProfile`), with a margin
(`MARGIN`, the factor the model's learning allows between a replica and its profile: faster hardware than the
profile's is tolerated up to it; beyond it the profile is wrong for this hardware and the hold says so):

- tokens a replica computes per second (prompt tokens it prefills, tokens it generates) at most its prefill
  throughput ceiling or its decode ceiling (`max_num_seqs` sequences, each one token per step of the step's
  fixed cost), whichever is larger; requests it finishes per second at most that (each costs at least a token);
- a prompt at most the KV cache (a longer one cannot run), so prompt tokens per request too; tokens generated per
  finished request too;
- sequences running at most `max_num_seqs`; requests waiting at most what could arrive at the request ceiling
  within the model's horizon;
- KV-cache usage within [0, 1]; latency quantiles at most a day (the engines' largest histogram bucket is about
  two hours; past the last bucket a quantile reads as that bucket's bound).

The replicas a pool's rates may come from are the ones that exist (ready, starting or pending, or the desired
count if larger): never fewer than one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from pdserve_operator.autoscaler.model import EngineProfile, ModelConfig
from pdserve_operator.autoscaler.signals import PodSample, PoolSignals, RouterSignals, ServiceSignals

__all__ = ["MARGIN", "MAX_LATENCY_S", "Limits", "bounded", "limits_of"]

#: How far past its engine profile a replica may measure (the model's learning allows the same factor).
MARGIN = 4.0
#: No latency quantile is longer than this (seconds).
MAX_LATENCY_S = 86_400.0


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    """What one replica of a pool can do at most (already including `MARGIN`)."""

    #: Tokens computed per second (prefilled or generated), and requests finished per second.
    tokens_per_s: float
    #: Tokens of one request (its prompt, its output): the KV cache.
    tokens_per_request: float
    #: Sequences running at once.
    running: float
    #: Requests waiting.
    waiting: float


def limits_of(profile: EngineProfile, horizon_s: float) -> Limits:
    """One replica's limits under `profile` (module docstring)."""
    decode_ceiling = profile.max_num_seqs / max(profile.decode_step_base_s(), 1e-9)
    tokens = MARGIN * max(profile.prefill_saturation(), decode_ceiling)
    return Limits(
        tokens_per_s=tokens,
        tokens_per_request=MARGIN * profile.kv_cache_tokens,
        running=MARGIN * profile.max_num_seqs,
        waiting=tokens * horizon_s,
    )


def bounded(signals: ServiceSignals, config: ModelConfig) -> ServiceSignals:
    """`signals` with every value the pools' replicas cannot produce removed (module docstring), the removals
    listed in `errors`."""
    rejected: list[str] = []
    prefill = _pool(signals.prefill, limits_of(config.prefill_profile, config.horizon_s), rejected)
    decode = _pool(signals.decode, limits_of(config.decode_profile, config.horizon_s), rejected)
    router = _router(signals.router, rejected)
    return dataclasses.replace(
        signals, prefill=prefill, decode=decode, router=router, errors=(*signals.errors, *rejected)
    )


# ------------------------------------------------------------------------------------------------------ checks


class _Checker:
    """Applies the bounds of one pool (or the routers), recording what it rejected."""

    def __init__(self, scope: str, rejected: list[str]) -> None:
        self.scope = scope
        self.rejected = rejected

    def value(self, name: str, value: float | None, limit: float, unit: str, why: str) -> float | None:
        """`value` when it is a finite number in [0, limit]; None otherwise (reported when it is a number out of
        range: a missing or non-finite value is simply not observed)."""
        if value is None or not math.isfinite(value):
            return None
        if value < 0 or value > limit:
            self.rejected.append(
                f"{self.scope} {name}: {value:.3g} {unit} is {'negative' if value < 0 else f'beyond {why}'}; "
                "not counted"
            )
            return None
        return value


def _pool(pool: PoolSignals, limits: Limits, rejected: list[str]) -> PoolSignals:
    replicas = float(max(pool.ready + pool.starting + pool.pending, pool.desired, 1))
    check = _Checker(pool.role, rejected)
    pool_tokens = limits.tokens_per_s * replicas
    tokens_why = f"what {replicas:.0f} replica(s) can compute ({pool_tokens:.3g} tok/s at most)"
    rates: dict[str, float | None] = {}
    for name in ("uncached_tokens_rate", "generated_tokens_rate"):
        rates[name] = check.value(name, getattr(pool, name), pool_tokens, "tok/s", tokens_why)
    requests = check.value(
        "request_rate", pool.request_rate, pool_tokens, "requests/s", f"what {replicas:.0f} replica(s) can finish"
    )
    prompt_limit = limits.tokens_per_request * (requests if requests is not None and requests > 0 else pool_tokens)
    prompts = check.value(
        "prompt_tokens_rate", pool.prompt_tokens_rate, prompt_limit, "tok/s", "a KV cache's worth per request"
    )
    per_request = limits.tokens_per_request
    if requests is not None and requests > 0:
        # Tokens per finished request (what the model divides by) beyond a KV cache's worth: not a request's.
        for name, value in (("uncached_tokens_rate", rates["uncached_tokens_rate"]),
                            ("generated_tokens_rate", rates["generated_tokens_rate"])):  # fmt: skip
            rates[name] = check.value(name, value, per_request * requests, "tok/s", "a KV cache's worth per request")
    latency = _latency(check)
    return dataclasses.replace(
        pool,
        pods=tuple(_pod(sample, limits, check) for sample in pool.pods),
        request_rate=requests,
        prompt_tokens_rate=prompts,
        uncached_tokens_rate=rates["uncached_tokens_rate"],
        generated_tokens_rate=rates["generated_tokens_rate"],
        prompt_tokens_quantile=check.value(
            "prompt_tokens_quantile", pool.prompt_tokens_quantile, per_request, "tokens", "a KV cache's worth"
        ),
        running=check.value("running", pool.running, limits.running * replicas, "sequences", "max_num_seqs"),
        waiting=check.value("waiting", pool.waiting, limits.waiting * replicas, "requests", "what can arrive"),
        waiting_capacity=check.value(
            "waiting_capacity", pool.waiting_capacity, limits.waiting * replicas, "requests", "what can arrive"
        ),
        waiting_deferred=check.value(
            "waiting_deferred", pool.waiting_deferred, limits.waiting * replicas, "requests", "what can arrive"
        ),
        kv_usage=check.value("kv_usage", pool.kv_usage, 1.0, "", "a full KV cache"),
        engine_ttft_s=latency("engine_ttft_s", pool.engine_ttft_s),
        engine_itl_s=latency("engine_itl_s", pool.engine_itl_s),
        queue_time_s=latency("queue_time_s", pool.queue_time_s),
        kv_transfer_s=latency("kv_transfer_s", pool.kv_transfer_s),
        freshness_s=_finite(pool.freshness_s),
        completeness=min(max(pool.completeness, 0.0), 1.0) if math.isfinite(pool.completeness) else 0.0,
    )


def _pod(sample: PodSample, limits: Limits, check: _Checker) -> PodSample:
    """One pod's sample within one replica's limits: what the capacity model learns from."""
    name = f"pod {sample.pod}"
    scope = _Checker(f"{check.scope} {name}", check.rejected)
    latency = _latency(scope)
    return dataclasses.replace(
        sample,
        load=scope.value("load", sample.load, limits.tokens_per_s, "tok/s", "what one replica can compute"),
        latency_s=latency("latency_s", sample.latency_s),
        running=scope.value("running", sample.running, limits.running, "sequences", "max_num_seqs"),
        waiting=scope.value("waiting", sample.waiting, limits.waiting, "requests", "what can arrive"),
        kv_usage=scope.value("kv_usage", sample.kv_usage, 1.0, "", "a full KV cache"),
        sample_age_s=_finite(sample.sample_age_s),
    )


def _router(router: RouterSignals, rejected: list[str]) -> RouterSignals:
    check = _Checker("router", rejected)
    latency = _latency(check)
    rate = router.request_rate
    return dataclasses.replace(
        router,
        ttft_s=latency("ttft_s", router.ttft_s),
        ttft_pd_s=latency("ttft_pd_s", router.ttft_pd_s),
        itl_s=latency("itl_s", router.itl_s),
        request_rate=None if rate is None or not math.isfinite(rate) or rate < 0 else rate,
        freshness_s=_finite(router.freshness_s),
    )


def _latency(check: _Checker) -> Callable[[str, float | None], float | None]:
    return lambda name, value: check.value(name, value, MAX_LATENCY_S, "s", "a day")


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) and value >= 0 else None
