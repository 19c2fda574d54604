"""The collector's queries against a real Prometheus scraping real simulators and a real router.

The local cluster's Prometheus (`prometheus` fixture, `pdserve_dev.testing.prometheus`) scrapes two prefill and
three decode simulators and a router in front of the live ones, added as static targets carrying the labels its
kubernetes_sd relabelling gives pods (`namespace`, `pod`, `pool`, `pdservice`). One decode, the "ghost", stands for
a pod that was deleted a moment ago: Prometheus still answers for its series, but it is not in the operator's pod
list. The test drives PD and decode-only requests through the router, keeps streams open on the ghost, and reads
the signals the way the operator's loop will: `Collector.collect` in a worker thread.

The end-to-end version (engine pods discovered through the API server, the operator's loop) is phase 2's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import aiohttp.web
import pytest

from pdserve.api.router_config import RouterConfig
from pdserve.api.settings import OperatorSettings
from pdserve_dev.cluster.prometheus import TARGET_LABELS
from pdserve_dev.testing.net import free_port
from pdserve_dev.testing.prometheus import PrometheusHelper
from pdserve_dev.testing.sim import SimHandle, sim_in_process
from pdserve_dev.testing.wait import wait_for_async
from pdserve_operator.autoscaler.collector import Collector, SeriesLabels, Target, connect
from pdserve_operator.autoscaler.decision import Reason
from pdserve_operator.autoscaler.signals import PodPhase, PodState
from pdserve_sim.config import SimConfig
from pdserve_sim.presets import CPU_TINY_SHARED
from tests.operator.autoscaler.support import autoscaler

# A tick's queries may take this long together (the operator's --prometheus-timeout).
TIMEOUT_S = OperatorSettings.prometheus_timeout
SERVICE = "chat"
LONG = "The history of the river valley settlements began with small farms. " * 30  # ~360 tokens: pd route
SHORT = "Say hi."  # decode-only route


def test_series_labels_are_the_ones_prometheus_is_configured_with() -> None:
    labels = SeriesLabels()
    assert {labels.namespace, labels.pod, labels.pool, labels.service} == set(TARGET_LABELS)


@contextlib.contextmanager
def _targets(prometheus: PrometheusHelper, namespace: str, targets: dict[str, tuple[str, str]]) -> Any:
    """Scrape each (pool, host:port) as pod `name` of PDService `chat` in `namespace`; removed afterwards."""
    jobs = []
    try:
        for name, (pool, address) in targets.items():
            job = f"{namespace}-{name}"
            labels = {"namespace": namespace, "pdservice": SERVICE, "pool": pool, "pod": name}
            prometheus.add_target(job, address, labels)
            jobs.append(job)
        yield
    finally:
        for job in jobs:
            prometheus.remove_target(job)


@contextlib.asynccontextmanager
async def _router(prefill: list[SimHandle], decode: list[SimHandle]) -> AsyncIterator[tuple[str, str]]:
    """(client URL, metrics URL) of a router in front of the engines."""
    from pdserve_runtime.router.app import RouterApp

    config = RouterConfig(
        served_model_name="sim-model",
        discovery="static",
        static_prefill=[s.url for s in prefill],
        static_decode=[s.url for s in decode],
    )
    app = RouterApp(config, access_log=False)
    port = await app.start("127.0.0.1", 0, metrics_port=0)
    try:
        yield f"http://127.0.0.1:{port}", app.metrics_url
    finally:
        await app.stop()


async def _complete(session: aiohttp.ClientSession, url: str, prompt: str, tokens: int) -> str:
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": tokens, "stream": True}
    async with session.post(url + "/v1/completions", json=body) as response:
        await response.read()
        assert response.status == 200
        return response.headers.get("X-Pdserve-Route", "")


def _pods(names: dict[str, str], ready_for_s: float = 120.0) -> list[PodState]:
    return [PodState(name, role, PodPhase.READY, ready_for_s) for name, role in names.items()]  # type: ignore[arg-type]


async def _query(prometheus: PrometheusHelper, promql: str) -> list[dict[str, Any]]:
    # The helper's client is synchronous: off the event loop, which serves the simulators Prometheus scrapes.
    return await asyncio.to_thread(prometheus.query, promql)


@pytest.mark.cluster
@pytest.mark.timeout(240)
async def test_collector_reads_live_pods_from_a_real_prometheus(prometheus: PrometheusHelper) -> None:
    namespace = f"collector-{uuid.uuid4().hex[:6]}"
    tiny = SimConfig(timing=CPU_TINY_SHARED, fast=False)
    async with contextlib.AsyncExitStack() as stack:
        sims = {
            name: await stack.enter_async_context(sim_in_process(tiny, role=role, engine_id=name))
            for name, role in (
                ("chat-prefill-0", "prefill"),
                ("chat-prefill-1", "prefill"),
                ("chat-decode-0", "decode"),
                ("chat-decode-1", "decode"),
                ("chat-decode-2", "decode"),
            )
        }
        ghost = "chat-decode-2"
        roles = {name: ("prefill" if "prefill" in name else "decode") for name in sims}
        router, router_metrics = await stack.enter_async_context(
            _router([sims["chat-prefill-0"], sims["chat-prefill-1"]], [sims["chat-decode-0"], sims["chat-decode-1"]])
        )
        targets = {name: (roles[name], sim.url.removeprefix("http://")) for name, sim in sims.items()}
        targets["chat-router-0"] = ("router", router_metrics.removeprefix("http://"))
        stack.enter_context(_targets(prometheus, namespace, targets))
        await asyncio.to_thread(prometheus.wait_for_targets, f'namespace="{namespace}"', len(targets))

        session = await stack.enter_async_context(aiohttp.ClientSession())
        load_started = time.monotonic()
        routes = await asyncio.gather(
            *(_complete(session, router, LONG + f" Request {i}.", 8) for i in range(24)),
            *(_complete(session, router, SHORT + f" {i}", 8) for i in range(12)),
        )
        assert routes.count("pd") == 24 and routes.count("decode-only") == 12
        # The ghost keeps streams open while the collector reads: its running gauge must not count.
        ghost_streams = [asyncio.create_task(_complete(session, sims[ghost].url, SHORT, 2000)) for _ in range(3)]
        ns = f'namespace="{namespace}"'

        async def settled() -> bool:
            # The last scrapes: every prefill finished, the live decodes idle again, the ghost busy.
            finished = await _query(prometheus, f'sum(vllm:request_success_total{{{ns},pool="prefill"}})')
            busy = await _query(prometheus, f'vllm:num_requests_running{{{ns},pod="{ghost}"}} > 0')
            idle = await _query(
                prometheus, f'vllm:num_requests_running{{{ns},pod=~"chat-decode-0|chat-decode-1"}} == 0'
            )
            # And the router's counters scraped after every PD request ended (its histograms are observed
            # before its counters, so they are in the same scrape or an earlier one).
            routed = await _query(prometheus, f'sum(pdserve_router_requests_total{{{ns},route="pd"}})')
            done = bool(finished) and float(finished[0]["value"][1]) >= 24
            return done and bool(routed) and float(routed[0]["value"][1]) >= 24 and bool(busy) and len(idle) == 2

        await wait_for_async(settled, within=60.0, interval=0.5, message="the load scraped, the ghost busy")

        # The rate window spans the whole load however long a busy machine took to settle: a window that starts
        # after the last PD request leaves no increase to read.
        window_s = max(30.0, time.monotonic() - load_started + 15.0)
        collector = Collector(connect(prometheus.url), deadline_s=TIMEOUT_S)
        target = Target(
            namespace, SERVICE, percentile=90, window_s=window_s, warmup_s=60.0, desired={"prefill": 2, "decode": 2}
        )
        live = {name: role for name, role in roles.items() if name != ghost}
        now = time.time()
        signals = await collector.collect(target, _pods(live), now, ("chat-router-0",))
        with_ghost = await collector.collect(target, _pods(roles), now, ("chat-router-0",))
        await collector.close()
        for task in ghost_streams:
            task.cancel()

    assert signals.errors == ()
    prefill, decode, routed = signals.prefill, signals.decode, signals.router
    # Per-pod samples: exactly the live ready pods, settled (ready 120 s > 60 s warm-up), fresh.
    assert sorted(p.pod for p in prefill.pods) == ["chat-prefill-0", "chat-prefill-1"]
    assert sorted(p.pod for p in decode.pods) == ["chat-decode-0", "chat-decode-1"]
    assert all(p.settled and p.sample_age_s is not None and p.sample_age_s < 5 for p in prefill.pods + decode.pods)
    assert prefill.completeness == decode.completeness == 1.0
    assert prefill.freshness_s is not None and prefill.freshness_s < 5
    # Load: the long prompts share a prefix, so prefix-cache hits discount prefill's work (uncached < prompt);
    # decode computed only the short prompts and generated the tokens.
    assert prefill.uncached_tokens_rate is not None and prefill.prompt_tokens_rate is not None
    assert 0 < prefill.uncached_tokens_rate < prefill.prompt_tokens_rate
    assert prefill.prompt_tokens_quantile is not None and prefill.prompt_tokens_quantile > 256
    assert decode.generated_tokens_rate is not None and decode.generated_tokens_rate > 0
    assert decode.uncached_tokens_rate is not None and decode.prompt_tokens_rate is not None
    assert decode.uncached_tokens_rate < 0.2 * decode.prompt_tokens_rate
    assert any(p.load for p in prefill.pods) and any(p.latency_s for p in decode.pods)
    # Latency quantiles at p90: prefill engine TTFT, decode ITL and KV pulls, the router's client-side view.
    assert prefill.engine_ttft_s is not None and decode.engine_itl_s is not None
    assert decode.kv_transfer_s is not None
    assert routed.ttft_s is not None and routed.ttft_pd_s is not None and routed.itl_s is not None
    assert routed.request_rate is not None and routed.request_rate > 0
    # The routers' queue gauges are read (0 here: late binding is off, nothing waits in the router).
    assert routed.queued_prefill_requests == routed.queued_prefill_tokens == routed.queued_decode_requests == 0.0
    # The live-pod filter: the ghost's series exist and are fresh, yet only count when it is listed.
    assert decode.running == 0, [(p.pod, p.running) for p in decode.pods]
    assert with_ghost.decode.running is not None and with_ghost.decode.running >= 3
    assert with_ghost.decode.completeness == 1.0 and len(with_ghost.decode.pods) == 3


@pytest.mark.cluster
@pytest.mark.timeout(120)
async def test_a_ready_pod_prometheus_has_not_scraped_lowers_completeness(prometheus: PrometheusHelper) -> None:
    namespace = f"collector-{uuid.uuid4().hex[:6]}"
    async with sim_in_process(role="prefill", engine_id="chat-prefill-0") as sim:
        with _targets(prometheus, namespace, {"chat-prefill-0": ("prefill", sim.url.removeprefix("http://"))}):
            await asyncio.to_thread(prometheus.wait_for_targets, f'namespace="{namespace}"', 1)
            collector = Collector(connect(prometheus.url), deadline_s=TIMEOUT_S)
            pods = _pods({"chat-prefill-0": "prefill", "chat-prefill-1": "prefill"}, ready_for_s=5.0)
            target = Target(namespace, SERVICE, 90, window_s=15.0, warmup_s=60.0)
            signals = await collector.collect(target, pods, time.time())
            await collector.close()
    assert signals.prefill.completeness == 0.5
    assert [p.sample_age_s is None for p in signals.prefill.pods] == [False, True]
    assert not any(p.settled for p in signals.prefill.pods), "ready 5 s < 60 s warm-up"


@pytest.mark.timeout(60)
async def test_prometheus_down_holds_every_pool_and_says_why() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    collector = Collector(connect(url), deadline_s=1.0)
    pods = _pods({"chat-prefill-0": "prefill", "chat-decode-0": "decode"})
    target = Target("team-a", SERVICE, 90, window_s=15.0, warmup_s=60.0, desired={"prefill": 3, "decode": 4})
    signals = await collector.collect(target, pods, time.time(), ("chat-router-0",))
    await collector.close()
    assert signals.errors and all("ConnectionError" in e for e in signals.errors)
    assert signals.prefill.uncached_tokens_rate is None and signals.decode.generated_tokens_rate is None
    assert signals.router.ttft_s is None
    decision = autoscaler((1, 10), (1, 10)).step(signals)
    assert (decision.prefill.desired, decision.decode.desired) == (3, 4)
    assert decision.prefill.reason is decision.decode.reason is Reason.METRICS_UNAVAILABLE
    active, _, _ = decision.conditions()
    assert active.status == "False" and "ConnectionError" in active.message


# An engine whose load metric vLLM renamed (as a new release could): every other series is there, at zero.
RENAMED_ENGINE_METRICS = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 0
# TYPE vllm:prompt_tokens_by_source counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 0
# TYPE vllm:request_success counter
vllm:request_success_total{engine="0",model_name="m",finished_reason="stop"} 0
# TYPE vllm:generated_tokens counter
vllm:generated_tokens_total{engine="0",model_name="m"} 0
"""


@pytest.mark.cluster
@pytest.mark.timeout(120)
async def test_a_metric_missing_while_prometheus_scrapes_the_pod_is_missing_not_zero(
    prometheus: PrometheusHelper,
) -> None:
    """Two decode engines export everything but `vllm:generation_tokens_total` (renamed): read as zero, it once took
    both pools to their minimum. Real Prometheus; the engines are a static exporter (the broken part under test)."""
    namespace = f"collector-{uuid.uuid4().hex[:6]}"

    async def metrics(request: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.Response(text=RENAMED_ENGINE_METRICS, content_type="text/plain")

    app = aiohttp.web.Application()
    app.router.add_get("/metrics", metrics)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    address = f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    names = {"chat-decode-0": "decode", "chat-decode-1": "decode"}
    try:
        with _targets(prometheus, namespace, {name: ("decode", address) for name in names}):
            await asyncio.to_thread(prometheus.wait_for_targets, f'namespace="{namespace}"', 2)
            # Two samples of each pod in the window: its rates exist (the counted event before asserting absence).
            # Every pod's, not any pod's: one scraped twice and the other once left that one's rates missing.
            two = f'count_over_time(up{{namespace="{namespace}"}}[15s]) >= 2'

            async def each_scraped_twice() -> bool:
                return len(await _query(prometheus, two)) == len(names)

            await wait_for_async(each_scraped_twice, within=60.0, interval=0.5, message="two scrapes of each pod")
            collector = Collector(connect(prometheus.url), deadline_s=TIMEOUT_S)
            target = Target(namespace, SERVICE, 90, window_s=15.0, warmup_s=60.0, desired={"prefill": 0, "decode": 2})
            signals = await collector.collect(target, _pods(names), time.time())
            await collector.close()
    finally:
        await runner.cleanup()
    assert signals.decode.generated_tokens_rate is None
    assert signals.decode.running == 0.0 and signals.decode.request_rate == 0.0  # the series that are there: zero
    assert signals.errors == (
        "decode generated_tokens: no series for pod chat-decode-0, chat-decode-1 although Prometheus scrapes it "
        "(the metric is missing or renamed; not read as zero)",
    )
    decision = autoscaler((0, 10), (1, 10)).step(signals)
    assert (decision.decode.reason, decision.decode.desired) == (Reason.METRICS_UNAVAILABLE, 2)
