"""The collector against a Prometheus that fails in ways a real one will not on demand (issue 18, item 4).

The Prometheus here is a stand-in (`pdserve_dev.testing.fake_prometheus`) on a real loopback socket; the collector
and its HTTP client are the product's. (A metric missing while its target is up is also checked against the real
Prometheus, in test_autoscaler_collector.py.)

- A Prometheus trickling its answer once made one collect take 298 s despite a 5 s timeout (the timeout bounded
  each socket read, and every one of the tick's 37 queries still ran). The stand-in sends its answer (the status
  line and headers, or only the body) one byte every 0.2 s and never finishes, so a collect can only return if
  the collector gives up at its one deadline for the tick.
- Empty answers while the targets are up (a metric vLLM renamed) once read as zero load and dropped both pools
  from 4 to their minimum: the stand-in answers every query but the renamed one.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import pytest

from pdserve_dev.testing.fake_prometheus import Trickle, fake_prometheus
from pdserve_operator.autoscaler.collector import ENGINE_QUERIES, ROUTER_QUERIES, Collector, Target, connect
from pdserve_operator.autoscaler.decision import Reason
from pdserve_operator.autoscaler.signals import PodPhase, PodState
from tests.operator.autoscaler.support import autoscaler

PODS = [
    PodState("chat-prefill-0", "prefill", PodPhase.READY, 120.0),
    PodState("chat-decode-0", "decode", PodPhase.READY, 120.0),
]
TARGET = Target("team-a", "chat", 90, window_s=15.0, warmup_s=60.0, desired={"prefill": 1, "decode": 1})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("trickle", ["headers", "body"])
async def test_a_trickling_prometheus_costs_a_tick_its_deadline_and_no_more(trickle: Trickle) -> None:
    async with fake_prometheus(trickle=trickle) as prometheus:
        collector = Collector(connect(prometheus.url), deadline_s=1.0)
        # The answer never completes: only the collector's deadline can end the collect (the 60 s are a guard).
        signals = await asyncio.wait_for(collector.collect(TARGET, PODS, time.time(), ("chat-router-0",)), 60)
        await asyncio.wait_for(prometheus.abandoned.wait(), 10)  # the query in flight was cancelled, its socket closed
        await collector.close()
    assert len(prometheus.queries) == 1  # the tick's other queries were never sent
    assert signals.errors == ("prefill uncached_tokens: the tick's deadline of 1 s for its queries passed",)
    every = [q.name for q in ENGINE_QUERIES] * 2 + [q.name for q in ROUTER_QUERIES]
    assert sorted(signals.failed_queries) == sorted(every)
    decision = autoscaler((1, 8), (1, 8)).step(signals)
    assert decision.prefill.reason is decision.decode.reason is Reason.METRICS_UNAVAILABLE
    assert (decision.prefill.desired, decision.decode.desired) == (1, 1)
    assert "deadline" in decision.prefill.message


async def test_slow_answers_share_the_ticks_one_deadline() -> None:
    """Each answer takes 0.3 s, under any per-query timeout: a tick of 37 queries would take 11 s. The tick's one
    deadline (1 s) stops it after the few queries that fit, and the pools hold."""
    async with fake_prometheus(delay_s=0.3) as prometheus:
        collector = Collector(connect(prometheus.url), deadline_s=1.0)
        signals = await asyncio.wait_for(collector.collect(TARGET, PODS, time.time(), ("chat-router-0",)), 60)
        await collector.close()
    every = [q.name for q in ENGINE_QUERIES] * 2 + [q.name for q in ROUTER_QUERIES]
    assert 1 <= len(prometheus.queries) < len(every) / 2
    [error] = signals.errors
    assert error.endswith("the tick's deadline of 1 s for its queries passed")


def answers(now: float, missing: str) -> Any:
    """Every query answered as for live, scraped, idle engines (0 for rates and gauges, each pod last scraped a
    second ago), except that metric `missing` has no series at all."""

    def answer(promql: str) -> list[dict[str, Any]]:
        match = re.search(r'pod=~"([^"]*)"', promql)
        pods = match.group(1).split("|") if match else []
        if missing in promql or "histogram_quantile" in promql:
            return []
        value = now - 1.0 if "timestamp(up" in promql else 0.0
        if "by (pod)" not in promql:
            return [{"metric": {}, "value": [now, str(value)]}]
        return [{"metric": {"pod": pod}, "value": [now, str(value)]} for pod in pods]

    return answer


@pytest.mark.timeout(60)
async def test_a_metric_missing_while_its_target_is_up_holds_the_pool_instead_of_reading_zero() -> None:
    now = time.time()
    pods = [
        PodState("chat-prefill-0", "prefill", PodPhase.READY, 120.0),
        *(PodState(f"chat-decode-{i}", "decode", PodPhase.READY, 120.0) for i in range(4)),
        PodState("chat-decode-4", "decode", PodPhase.READY, 5.0),  # ready 5 s: no rate yet, and none required
    ]
    target = Target("team-a", "chat", 90, window_s=15.0, warmup_s=60.0, desired={"prefill": 1, "decode": 5})
    async with fake_prometheus(answer=answers(now, "vllm:generation_tokens_total")) as prometheus:
        collector = Collector(connect(prometheus.url), deadline_s=5.0)
        signals = await collector.collect(target, pods, now)
        await collector.close()
    assert signals.decode.generated_tokens_rate is None and signals.prefill.generated_tokens_rate is None
    assert signals.decode.running == 0.0  # present, and truly zero
    assert signals.errors == (
        "prefill generated_tokens: no series for pod chat-prefill-0 although Prometheus scrapes it (the metric is "
        "missing or renamed; not read as zero)",
        "decode generated_tokens: no series for pod chat-decode-0, chat-decode-1, chat-decode-2 although Prometheus "
        "scrapes it (the metric is missing or renamed; not read as zero)",
    )
    assert signals.failed_queries == ("generated_tokens", "generated_tokens")
    decision = autoscaler((1, 8), (1, 8)).step(signals)
    assert (decision.decode.reason, decision.decode.desired) == (Reason.METRICS_UNAVAILABLE, 5)
    assert "no series for pod chat-decode-0" in decision.decode.message


@pytest.mark.timeout(60)
async def test_a_pod_ready_for_less_than_the_window_owes_no_rate() -> None:
    now = time.time()
    pods = [PodState("chat-decode-0", "decode", PodPhase.READY, 5.0)]
    target = Target("team-a", "chat", 90, window_s=15.0, warmup_s=60.0, desired={"prefill": 0, "decode": 1})
    async with fake_prometheus(answer=answers(now, "vllm:generation_tokens_total")) as prometheus:
        collector = Collector(connect(prometheus.url), deadline_s=5.0)
        signals = await collector.collect(target, pods, now)
        await collector.close()
    assert signals.errors == () and signals.decode.generated_tokens_rate == 0.0
