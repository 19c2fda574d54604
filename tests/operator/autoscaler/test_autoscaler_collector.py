"""The collector's queries against a real Prometheus scraping real simulators and a real router.

Two prefill and three decode simulators (one decode, the "ghost", stands for a pod that was deleted a moment
ago: Prometheus still answers for its series, but it is not in the operator's pod list), a router in front of the
live ones, and Prometheus (the binary pdserve's local cluster builds, `~/.cache/pdserve/prometheus/*/bin`) with
static targets carrying the labels its kubernetes_sd relabelling gives pods (`namespace`, `pod`, `pool`,
`pdservice`). The test drives PD and decode-only requests through the router, keeps streams open on the ghost,
and reads the signals the way the operator's loop will: `Collector.collect` in a worker thread.

Remaining when `pdserve_dev.testing.prometheus` lands on relayer: start Prometheus through it (this file's
`_prometheus` is a stand-in with the same binary and labels) and add the kubernetes_sd end-to-end test on the
local cluster (phase 2).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from pdserve.api.router_config import RouterConfig
from pdserve_dev.testing.net import free_port
from pdserve_dev.testing.sim import SimHandle, sim_in_process
from pdserve_dev.testing.wait import wait_for_async
from pdserve_operator.autoscaler.collector import Collector, Target, connect
from pdserve_operator.autoscaler.core import Autoscaler, AutoscalerConfig
from pdserve_operator.autoscaler.decision import Reason
from pdserve_operator.autoscaler.model import ModelConfig, Slo
from pdserve_operator.autoscaler.policy import PolicyConfig, PoolBounds
from pdserve_operator.autoscaler.signals import PodPhase, PodState, ServiceSignals
from pdserve_sim.config import SimConfig
from pdserve_sim.presets import CPU_TINY

pytestmark = pytest.mark.timeout(180)

NAMESPACE, SERVICE = "team-a", "chat"
LONG = "The history of the river valley settlements began with small farms. " * 30  # ~360 tokens: pd route
SHORT = "Say hi."  # decode-only route
CACHE = Path.home() / ".cache" / "pdserve" / "prometheus"


def _prometheus_binary() -> Path | None:
    explicit = os.environ.get("PDSERVE_PROMETHEUS_BIN")
    if explicit:
        return Path(explicit)
    found = sorted(CACHE.glob("*/bin/prometheus"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


@pytest.fixture(scope="module")
def prometheus_binary() -> Path:
    binary = _prometheus_binary()
    if binary is None or not binary.exists():
        pytest.skip("no Prometheus binary: build it with `pdserve dev cluster build` (or set PDSERVE_PROMETHEUS_BIN)")
    return binary


@contextlib.contextmanager
def _prometheus(binary: Path, workdir: Path, targets: dict[str, tuple[str, str]]) -> Iterator[str]:
    """Prometheus on loopback scraping `targets` (pod name -> (pool, host:port)) every second; stopped by PID."""
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "900ms", "evaluation_interval": "1s"},
        "scrape_configs": [
            {
                "job_name": "pdserve",
                "static_configs": [
                    {
                        "targets": [address],
                        "labels": {"namespace": NAMESPACE, "pdservice": SERVICE, "pool": pool, "pod": pod},
                    }
                    for pod, (pool, address) in targets.items()
                ],
            }
        ],
    }
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    process = subprocess.Popen(
        [
            str(binary),
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(workdir / "prometheus.log").open("w"),
        start_new_session=True,
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@contextlib.asynccontextmanager
async def _router(prefill: list[SimHandle], decode: list[SimHandle]) -> AsyncIterator[str]:
    from pdserve_runtime.router.app import RouterApp

    config = RouterConfig(
        served_model_name="sim-model",
        discovery="static",
        static_prefill=[s.url for s in prefill],
        static_decode=[s.url for s in decode],
    )
    runner = web.AppRunner(RouterApp(config).web_app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def _complete(session: aiohttp.ClientSession, url: str, prompt: str, tokens: int) -> str:
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": tokens, "stream": True}
    async with session.post(url + "/v1/completions", json=body) as response:
        await response.read()
        assert response.status == 200
        return response.headers.get("X-Pdserve-Route", "")


def _pods(names: dict[str, str], ready_for_s: float = 120.0) -> list[PodState]:
    return [PodState(name, role, PodPhase.READY, ready_for_s) for name, role in names.items()]  # type: ignore[arg-type]


async def _query(url: str, promql: str) -> list[dict[str, Any]]:
    client = connect(url)
    result: list[dict[str, Any]] = await asyncio.to_thread(client.custom_query, promql)
    return result


async def test_collector_reads_live_pods_from_a_real_prometheus(prometheus_binary: Path, tmp_path: Path) -> None:
    tiny = SimConfig(timing=CPU_TINY, fast=False)
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
        router = await stack.enter_async_context(
            _router([sims["chat-prefill-0"], sims["chat-prefill-1"]], [sims["chat-decode-0"], sims["chat-decode-1"]])
        )
        targets = {name: (roles[name], sim.url.removeprefix("http://")) for name, sim in sims.items()}
        targets["chat-router-0"] = ("router", router.removeprefix("http://"))
        url = stack.enter_context(_prometheus(prometheus_binary, tmp_path, targets))

        async def all_up() -> bool:
            return len(await _query(url, 'up{job="pdserve"} == 1')) == len(targets)

        await wait_for_async(all_up, within=60.0, interval=0.5, message="every target scraped")

        session = await stack.enter_async_context(aiohttp.ClientSession())
        routes = await asyncio.gather(
            *(_complete(session, router, LONG + f" Request {i}.", 8) for i in range(24)),
            *(_complete(session, router, SHORT + f" {i}", 8) for i in range(12)),
        )
        assert routes.count("pd") == 24 and routes.count("decode-only") == 12
        # The ghost keeps streams open while the collector reads: its running gauge must not count.
        ghost_streams = [asyncio.create_task(_complete(session, sims[ghost].url, SHORT, 2000)) for _ in range(3)]

        async def ghost_running() -> bool:
            # The last scrape of every decode pod: the live ones idle (their requests all finished), the ghost busy.
            busy = await _query(url, f'vllm:num_requests_running{{pod="{ghost}"}} > 0')
            idle = await _query(url, 'vllm:num_requests_running{pod=~"chat-decode-0|chat-decode-1"} == 0')
            return bool(busy) and len(idle) == 2

        async def scraped_after_load() -> bool:
            finished = await _query(url, 'sum(vllm:request_success_total{pool="prefill"})')
            return bool(finished) and float(finished[0]["value"][1]) >= 24

        await wait_for_async(scraped_after_load, within=30.0, interval=0.5, message="the load scraped")
        await wait_for_async(ghost_running, within=30.0, interval=0.5, message="live decodes idle, the ghost busy")

        collector = Collector(connect(url), window_s=30.0, warmup_s=60.0)
        target = Target(NAMESPACE, SERVICE, percentile=90, desired={"prefill": 2, "decode": 2})
        live = {name: role for name, role in roles.items() if name != ghost}
        now = time.time()
        signals: ServiceSignals = await asyncio.to_thread(
            collector.collect, target, _pods(live), now, ("chat-router-0",)
        )
        with_ghost: ServiceSignals = await asyncio.to_thread(
            collector.collect, target, _pods(roles), now, ("chat-router-0",)
        )
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
    # The live-pod filter: the ghost's series exist and are fresh, yet only count when it is listed.
    assert decode.running == 0, [(p.pod, p.running) for p in decode.pods]
    assert with_ghost.decode.running is not None and with_ghost.decode.running >= 3
    assert with_ghost.decode.completeness == 1.0 and len(with_ghost.decode.pods) == 3


async def test_a_ready_pod_prometheus_has_not_scraped_lowers_completeness(
    prometheus_binary: Path, tmp_path: Path
) -> None:
    async with sim_in_process(role="prefill", engine_id="chat-prefill-0") as sim:
        with _prometheus(prometheus_binary, tmp_path, {"chat-prefill-0": ("prefill", sim.url[7:])}) as url:

            async def up() -> bool:
                return len(await _query(url, "up == 1")) == 1

            await wait_for_async(up, within=60.0, interval=0.5, message="the target scraped")
            collector = Collector(connect(url), window_s=15.0)
            pods = _pods({"chat-prefill-0": "prefill", "chat-prefill-1": "prefill"}, ready_for_s=5.0)
            signals = await asyncio.to_thread(collector.collect, Target(NAMESPACE, SERVICE, 90), pods, time.time())
    assert signals.prefill.completeness == 0.5
    assert [p.sample_age_s is None for p in signals.prefill.pods] == [False, True]
    assert not any(p.settled for p in signals.prefill.pods), "ready 5 s < 60 s warm-up"


async def test_prometheus_down_holds_every_pool_and_says_why() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    collector = Collector(connect(url, timeout_s=1.0))
    pods = _pods({"chat-prefill-0": "prefill", "chat-decode-0": "decode"})
    target = Target(NAMESPACE, SERVICE, 90, desired={"prefill": 3, "decode": 4})
    signals = await asyncio.to_thread(collector.collect, target, pods, time.time(), ("chat-router-0",))
    assert signals.errors and all("ConnectionError" in e for e in signals.errors)
    assert signals.prefill.uncached_tokens_rate is None and signals.decode.generated_tokens_rate is None
    assert signals.router.ttft_s is None
    config = AutoscalerConfig(
        model=ModelConfig(slo=Slo(0.8, 0.04)),
        policy=PolicyConfig(prefill=PoolBounds(1, 10), decode=PoolBounds(1, 10)),
    )
    decision = Autoscaler(config).step(signals)
    assert (decision.prefill.desired, decision.decode.desired) == (3, 4)
    assert decision.prefill.reason is decision.decode.reason is Reason.METRICS_UNAVAILABLE
    active, _, _ = decision.conditions()
    assert active.status == "False" and "ConnectionError" in active.message
