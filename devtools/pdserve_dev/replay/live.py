"""Closed-loop replay on the local cluster: the same requests as the discrete-event replay, through the real product.

A fresh local cluster (control plane, the process node running engine pods as `pdserve sim` processes with the
`h200-8b` timing model, the cluster's Prometheus), the operator as a process with `--prometheus-url` (its real
autoscaler loop), a PDService sized and bounded like the replay's, and the requests sent through the PD router at
their arrival times (`pdserve_dev.testing.load`, streamed so that TTFT and time per output token are the
client's). What it measures is what `Outcome` measures in the discrete-event replay:

- attainment: the share of requests answered with TTFT <= target and mean time per output token <= ITL target
  (failed requests count as misses);
- GPU-seconds: the pools' existing pods (StatefulSet `status.replicas`: starting, serving or draining) sampled every
  second over the replay, x GPUs per pod (1 here);
- scaling actions: the autoscaler's `Scaled` Events;
- the loop's timing, for the replay to take: the operator's ticks (`TickLog`, from its metrics), when the router
  used each threshold, and when Prometheus last scraped the first engines and the router (`last_scrapes`).

It is slow (real time) and small (one machine's CPUs run every engine, the router and the load): a slice of a
trace at a rate of a few requests per second, with pods that start in seconds. The benchmark prints it beside the
discrete-event results of the same slice (`bench/autoscaler_bench.py --cluster`).

The caller runs in a network namespace with only loopback (the cluster's pod addresses must stay on the machine);
`bench/autoscaler_bench.py` re-executes itself in one, as `pdserve dev demo` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import shutil
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from pdserve.api.crdgen import custom_resource_definition
from pdserve_dev.cluster.cluster import LocalCluster
from pdserve_dev.process_node.node import SELECTOR, TOLERATION
from pdserve_dev.replay.trace import Request
from pdserve_dev.testing.cluster import ClusterHelper
from pdserve_dev.testing.load import Answer, Load
from pdserve_dev.testing.metrics import by_label, series
from pdserve_dev.testing.operator import OperatorProcess
from pdserve_dev.testing.prometheus import PrometheusHelper
from pdserve_dev.testing.wait import wait_for

NAMESPACE = "replay"
NAME = "live"
MODEL = "tiny-llama"
ROLES = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class LiveConfig:
    """The PDService and the operator's timing for a live replay."""

    ttft_s: float
    itl_s: float
    percentile: int = 90
    prefill: tuple[int, int] = (1, 3)
    decode: tuple[int, int] = (1, 2)
    initial: tuple[int, int] = (1, 1)
    threshold: int = 256
    #: spec.autoscaling.disaggregationThreshold (lowest, highest): the autoscaler chooses the threshold within them.
    threshold_bounds: tuple[int, int] | None = None
    #: spec.router.routing.lateBinding: the router's queue dispatches only to engines with room (the replay's
    #: LateBinding), with decode's budget from decode.maxNumSeqs (h200-8b's 256, stated so it is rendered).
    late_binding: bool = True
    decode_max_num_seqs: int = 256
    interval_s: float = 2.0
    window_s: float = 6.0
    warmup_s: int = 10
    scale_down_s: int = 30
    max_model_len: int = 16384


@dataclass
class LiveOutcome:
    """What the live replay measured."""

    answers: list[Answer]
    failed: int
    failures: list[str]
    #: Requests the router refused or shed (429 and 503 answers; also counted in `failed`).
    shed: int
    gpu_seconds: float
    actions: int
    #: (seconds since the first arrival, prefill pods, decode pods), one per second.
    timeline: list[tuple[float, int, int]] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    seconds: float = 0.0
    #: (seconds since the first arrival, tokens) from the start and at every change of the disaggregation
    #: threshold the operator published (`status.disaggregationThreshold.tokens`).
    thresholds: list[tuple[float, int]] = field(default_factory=list)
    threshold_events: list[str] = field(default_factory=list)
    #: (seconds since the first arrival, tokens) of the threshold the router uses
    #: (`pdserve_router_disaggregation_threshold`, read every 0.2 s), from the start and at every change.
    router_thresholds: list[tuple[float, int]] = field(default_factory=list)
    #: Seconds from each added pod's creation (as sampled) to the pool having that many Ready (`startup_delays`).
    startups: list[float] = field(default_factory=list)
    #: Seconds from each added pod's creation to the router having that many of the pool's engines up (its
    #: `pdserve_router_endpoint_up`, read every 0.2 s): Ready, then the EndpointSlice, then the router's watch.
    routable: list[float] = field(default_factory=list)
    #: Where the time went (`latency_breakdown`): name -> (p50, p90, mean) seconds over the whole replay.
    latencies: dict[str, tuple[float | None, float | None, float | None]] = field(default_factory=dict)
    #: time.monotonic() at the replay's time 0 (an answer's `started` less this is its arrival in the trace).
    began: float = 0.0
    #: Every autoscaler tick the operator made during the replay (`TickLog`, its metrics read every 0.2 s).
    ticks: list[Tick] = field(default_factory=list)
    #: time.time() at the replay's time 0.
    began_unix: float = 0.0
    #: Unix time of the cluster's Prometheus' last scrape of the first engine of each pool and of the router, read
    #: after the replay (`last_scrapes`): with the scrape interval, when every scrape of that target came.
    scrapes: dict[str, float] = field(default_factory=dict)

    def attainment(self, ttft_s: float, itl_s: float) -> float:
        total = len(self.answers) + self.failed
        good = sum(1 for a in self.answers if answered_in_slo(a, ttft_s, itl_s))
        return good / total if total else 0.0


def answered_in_slo(answer: Answer, ttft_s: float, itl_s: float) -> bool:
    """Whether an answer met both targets (TTFT and mean time per output token), as `attainment` counts it."""
    return answer.ttft_s <= ttft_s and answer.tpot_s <= itl_s


def manifest(config: LiveConfig) -> dict[str, Any]:
    def pool(bounds: tuple[int, int], initial: int, **extra: Any) -> dict[str, Any]:
        return {
            "replicas": initial,
            "autoscaling": {"enabled": True, "minReplicas": bounds[0], "maxReplicas": bounds[1]},
            **extra,
        }

    return {
        "apiVersion": "pdserve.io/v1alpha1",
        "kind": "PDService",
        "metadata": {"name": NAME, "namespace": NAMESPACE},
        "spec": {
            "model": {"name": MODEL, "uri": "hf://pdserve/tiny-llama"},
            "engine": {
                "image": "vllm/vllm-openai:v0.32.0",
                "maxModelLen": config.max_model_len,
                "env": [{"name": "PDSERVE_SIM_PRESET", "value": "h200-8b"}],
                "drainSeconds": 30,
            },
            "prefill": pool(config.prefill, config.initial[0]),
            "decode": pool(config.decode, config.initial[1], maxNumSeqs=config.decode_max_num_seqs),
            "placement": {"gpuNodeSelector": SELECTOR, "tolerations": [TOLERATION], "rdma": "off"},
            "router": {
                "replicas": 1,
                "nodeSelector": SELECTOR,
                "tolerations": [TOLERATION],
                "routing": {"disaggregationThreshold": config.threshold, "lateBinding": config.late_binding},
            },
            "slo": {
                "ttftMilliseconds": config.ttft_s * 1000,
                "itlMilliseconds": config.itl_s * 1000,
                "percentile": config.percentile,
            },
            "autoscaling": {
                "warmupSeconds": config.warmup_s,
                "scaleDownStabilizationSeconds": config.scale_down_s,
                **_threshold_bounds(config),
            },
        },
    }


def _threshold_bounds(config: LiveConfig) -> dict[str, Any]:
    if config.threshold_bounds is None:
        return {}
    lowest, highest = config.threshold_bounds
    return {"disaggregationThreshold": {"minTokens": lowest, "maxTokens": highest}}


def run_live(
    requests: Sequence[Request], config: LiveConfig, log: Callable[[str], None], workdir: Path | None = None
) -> LiveOutcome:
    """Replay `requests` through the product on a fresh local cluster (module docstring); everything it starts is
    stopped before it returns. Without a `workdir` its files go to a temporary folder, removed after a run that
    returned and kept (the path logged) after one that failed: the operator's and the engines' logs say why."""
    root = workdir or Path(tempfile.mkdtemp(prefix="pdserve-live-"))
    returned = False
    cluster = LocalCluster(root / "cluster", topology="minimal", process_node=True, log=log)
    operator: OperatorProcess | None = None
    try:
        cluster.start()
        helper = ClusterHelper.from_cluster(cluster)
        prometheus = PrometheusHelper.for_cluster(cluster)
        helper.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(custom_resource_definition()))
        helper.wait_crd_established()
        helper.kubectl("create", "namespace", NAMESPACE)
        flags = [
            f"--prometheus-url={prometheus.url}",
            f"--autoscaler-interval-seconds={config.interval_s}",
            f"--autoscaler-window-seconds={config.window_s}",
        ]
        operator = OperatorProcess(cluster.kubeconfig, root / "operator.log", namespaces=[NAMESPACE], extra=flags)
        operator.start().wait_ready()
        helper.apply(manifest(config))
        helper.kubectl(
            "wait", "--for=condition=Available", f"pds/{NAME}", f"--namespace={NAMESPACE}", "--timeout=180s",
            timeout=200,
        )  # fmt: skip
        prometheus.wait_for_targets(f'namespace="{NAMESPACE}"', sum(config.initial) + 1, timeout=60)
        router = wait_for(lambda: helper.pod_ips(NAMESPACE, "pdserve.io/role=router"), timeout=60)[0]
        log(f"   live: PDService ready, replaying {len(requests)} requests through the router at {router}")
        outcome = asyncio.run(_replay(helper, f"http://{router}:8080", requests, log, operator.exposition))
        time.sleep(2.0)  # the last answers' metrics: one more scrape (every second)
        outcome.latencies = latency_breakdown(prometheus, outcome.seconds)
        outcome.scrapes = last_scrapes(prometheus)
        returned = True
        return outcome
    finally:
        if operator is not None:
            operator.stop()
        cluster.stop()
        if workdir is None and returned:
            shutil.rmtree(root, ignore_errors=True)
        elif workdir is None:
            log(f"   live: the run's files (operator and engine logs) stay in {root}")


async def _replay(
    helper: ClusterHelper,
    base: str,
    requests: Sequence[Request],
    log: Callable[[str], None],
    operator_metrics: Callable[[], str],
) -> LiveOutcome:
    timeline: list[tuple[float, int, int]] = []
    thresholds: list[tuple[float, int]] = []
    ready_timeline: list[tuple[float, int, int]] = []
    stop = threading.Event()
    began = time.monotonic()
    began_unix = time.time()

    def sample() -> None:
        # Pods that exist (starting, serving or draining) are what GPUs are held for. One API client for the
        # whole replay (not a kubectl process a second, whose start-up CPU the product under test would pay).
        with helper.api_client() as api:
            while not stop.is_set():
                _sample_once(api)
                stop.wait(1.0)

    def _sample_once(api: Any) -> None:
        items = _list_json(api)
        at = time.monotonic() - began
        sets = {s["metadata"]["name"]: s.get("status") or {} for s in items if s["kind"] == "StatefulSet"}
        pods = [int(sets.get(f"{NAME}-{role}", {}).get("replicas", 0)) for role in ROLES]
        ready = [int(sets.get(f"{NAME}-{role}", {}).get("readyReplicas", 0)) for role in ROLES]
        timeline.append((at, pods[0], pods[1]))
        ready_timeline.append((at, ready[0], ready[1]))
        for pds in (i for i in items if i["kind"] == "PDService"):
            tokens = ((pds.get("status") or {}).get("disaggregationThreshold") or {}).get("tokens")
            if isinstance(tokens, int) and (not thresholds or thresholds[-1][1] != tokens):
                thresholds.append((at, tokens))

    routed: list[tuple[float, int, int]] = []
    ticks = TickLog()
    router_thresholds: list[tuple[float, int]] = []
    metrics_url = base.rsplit(":", 1)[0] + ":9090/metrics"

    def sample_router() -> None:
        # Which engines the router uses: its own endpoint gauges, read often (a pod is routable only from here on).
        while not stop.is_set():
            with contextlib.suppress(OSError, ValueError):
                with urllib.request.urlopen(metrics_url, timeout=1.0) as response:
                    text = response.read().decode()
                up = [
                    sum(1 for labels, value in series(text, "pdserve_router_endpoint_up", role=role) if value == 1)
                    for role in ROLES
                ]
                at = time.monotonic() - began
                routed.append((at, up[0], up[1]))
                used = [int(value) for _, value in series(text, "pdserve_router_disaggregation_threshold")]
                if used and (not router_thresholds or router_thresholds[-1][1] != used[0]):
                    router_thresholds.append((at, used[0]))
            with contextlib.suppress(OSError, ValueError):
                ticks.see(operator_metrics(), began_unix)
            stop.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    router_sampler = threading.Thread(target=sample_router, daemon=True)
    router_sampler.start()
    async with Load(base, MODEL, seed=11) as load:
        for request in requests:
            delay = request.arrival - (time.monotonic() - began)
            if delay > 0:
                await asyncio.sleep(delay)
            load.send(request.prompt, request.output, stream=True)
        await load.close(drain=True, within=120.0)
    stop.set()
    sampler.join(5)
    router_sampler.join(5)
    elapsed = time.monotonic() - began
    gpu_seconds = sum((p + d) * (timeline[i + 1][0] - t) for i, (t, p, d) in enumerate(timeline[:-1]))
    messages, threshold_messages = (_events(helper, reason) for reason in ("Scaled", "DisaggregationThreshold"))
    log(
        f"   live: {load.stats.ok} answered, {load.stats.failed} failed, {len(messages)} scaling actions, "
        f"{len(threshold_messages)} threshold changes"
    )
    return LiveOutcome(
        answers=load.stats.answers,
        failed=load.stats.failed,
        failures=load.stats.failures,
        shed=load.stats.statuses[429] + load.stats.statuses[503],
        gpu_seconds=gpu_seconds,
        actions=len(messages),
        timeline=timeline,
        events=messages,
        seconds=elapsed,
        thresholds=thresholds,
        threshold_events=threshold_messages,
        began=began,
        began_unix=began_unix,
        startups=startup_delays(timeline, ready_timeline),
        routable=startup_delays(timeline, routed),
        router_thresholds=router_thresholds,
        ticks=[tick for tick in ticks.ticks if tick.at >= 0],
    )


class Tick(NamedTuple):
    """One autoscaler tick of the operator, as its metrics show it."""

    #: Seconds since the replay's first arrival (its `pdserve_autoscaler_last_tick_timestamp_seconds`).
    at: float
    #: The threshold decision's reason (the one `pdserve_autoscaler_threshold_decisions_total` counted; "" if none).
    reason: str
    #: What it observed and wanted: `observed_latency_seconds:<kind>`, `demand:<pool>`, `desired_replicas:<pool>`.
    seen: dict[str, float]


class TickLog:
    """The operator's autoscaler ticks, from its metrics read now and then (`see`): a new value of
    `pdserve_autoscaler_last_tick_timestamp_seconds` is a tick, and the `pdserve_autoscaler_threshold_decisions_total`
    reason that grew since the last read is its threshold decision. Beside each tick, what it saw and wanted: the
    latencies it observed by kind, each pool's demand and desired replicas."""

    TICK = "pdserve_autoscaler_last_tick_timestamp_seconds"
    REASONS = "pdserve_autoscaler_threshold_decisions_total"
    #: Gauges kept per tick, each with the label that names its values.
    GAUGES = (
        ("pdserve_autoscaler_observed_latency_seconds", "kind"),
        ("pdserve_autoscaler_demand", "pool"),
        ("pdserve_autoscaler_desired_replicas", "pool"),
    )

    def __init__(self) -> None:
        self.ticks: list[Tick] = []
        self._last: float | None = None
        self._counts: dict[str, float] = {}

    def see(self, exposition: str, began_unix: float) -> None:
        """One read of the operator's metrics (`OperatorProcess.exposition`); times are kept as seconds since
        `began_unix` (the replay's time 0 on the wall clock)."""
        stamps = [value for _, value in series(exposition, self.TICK)]
        counts = by_label(exposition, self.REASONS, "reason")
        grew = [reason for reason, value in counts.items() if value > self._counts.get(reason, 0.0)]
        self._counts = counts
        if not stamps or stamps[0] == self._last:
            return
        self._last = stamps[0]
        seen = {
            f"{name.removeprefix('pdserve_autoscaler_')}:{key}": value
            for name, label in self.GAUGES
            for key, value in by_label(exposition, name, label).items()
        }
        self.ticks.append(Tick(round(stamps[0] - began_unix, 3), grew[0] if grew else "", seen))


def _list_json(api: Any) -> list[dict[str, Any]]:
    """The replay namespace's StatefulSets and PDServices as JSON (no generated models), each item with its `kind`
    (a list's items carry none)."""
    from kubernetes import client  # lazy, as `ClusterHelper.api_client`: slow to import

    apps: Any = client.AppsV1Api(api)
    custom: Any = client.CustomObjectsApi(api)
    sets = apps.list_namespaced_stateful_set(NAMESPACE, _preload_content=False, _request_timeout=10)
    services = custom.list_namespaced_custom_object(
        "pdserve.io", "v1alpha1", NAMESPACE, "pdservices", _preload_content=False, _request_timeout=10
    )
    return [
        {**item, "kind": kind}
        for kind, response in (("StatefulSet", sets), ("PDService", services))
        for item in json.loads(response.data)["items"]
    ]


def startup_delays(existing: Sequence[tuple[float, int, int]], ready: Sequence[tuple[float, int, int]]) -> list[float]:
    """Seconds from a pool growing (its existing pods sampled one more) to as many pods Ready, per added pod
    that became Ready within the replay: what the replay's `startup_s` stands for, measured. `ready` may be
    sampled at other times than `existing` (the router's view of the engines is)."""
    delays: list[float] = []
    for pool in (1, 2):
        for index in range(1, len(existing)):
            before, now = int(existing[index - 1][pool]), int(existing[index][pool])
            at = existing[index][0]
            for count in range(before + 1, now + 1):
                when = next((t for t, *counts in ready if t >= at and counts[pool - 1] >= count), None)
                if when is not None:
                    delays.append(round(when - at, 1))
    return delays


#: The hops of a request, as the router and the engines histogram them: (name, metric, extra selector).
BREAKDOWN = (
    ("router TTFT, PD route", "pdserve_router_time_to_first_token_seconds", ',route="pd"'),
    ("router TTFT, decode only", "pdserve_router_time_to_first_token_seconds", ',route="decode-only"'),
    ("router queue wait", "pdserve_router_queue_wait_seconds", ""),
    ("prefill engine TTFT (queue + prefill)", "vllm:time_to_first_token_seconds", f',pod=~"{NAME}-prefill-.*"'),
    ("decode engine TTFT (slot, KV pull, step)", "vllm:time_to_first_token_seconds", f',pod=~"{NAME}-decode-.*"'),
    ("decode queue time", "vllm:request_queue_time_seconds", f',pod=~"{NAME}-decode-.*"'),
    ("KV transfer", "vllm:nixl_xfer_time_seconds", ""),
    ("decode ITL", "vllm:inter_token_latency_seconds", f',pod=~"{NAME}-decode-.*"'),
    ("router's own share of its TTFT", "pdserve_router_added_latency_seconds", ""),
)


def latency_breakdown(
    prometheus: PrometheusHelper, seconds: float
) -> dict[str, tuple[float | None, float | None, float | None]]:
    """p50, p90 and mean of each hop (`BREAKDOWN`) over the last `seconds`, from the cluster's Prometheus: where
    a closed loop's TTFT went, to set beside the replay's model of the same hops. The quantiles are interpolated
    within buckets; the mean (the histogram's sum over its count) is exact, and means add up along a path."""
    window = f"{math.ceil(seconds) + 5}s"
    out: dict[str, tuple[float | None, float | None, float | None]] = {}
    for name, metric, extra in BREAKDOWN:
        selector = f'namespace="{NAMESPACE}"{extra}'
        quantiles = [
            prometheus.value(
                f"histogram_quantile({q}, sum by (le) (increase({metric}_bucket{{{selector}}}[{window}])))"
            )
            for q in (0.5, 0.9)
        ]
        total, count = (f"sum(increase({metric}_{part}{{{selector}}}[{window}]))" for part in ("sum", "count"))
        mean = prometheus.value(f"{total} / {count}")
        out[name] = (quantiles[0], quantiles[1], mean)
    return out


def last_scrapes(prometheus: PrometheusHelper) -> dict[str, float]:
    """When Prometheus last scraped the first prefill engine, the first decode engine and a router (pool -> Unix
    time, `timestamp(up)`): a scrape's data is what a tick reads until the next, so its phase against the ticks' is
    how old what the autoscaler saw was. Pools it finds no target of are left out."""
    pods = {"prefill": f"{NAME}-prefill-0", "decode": f"{NAME}-decode-0", "router": f"{NAME}-router-.+"}
    found: dict[str, float] = {}
    for pool, pod in pods.items():
        stamp = prometheus.value(f'max(timestamp(up{{namespace="{NAMESPACE}",pod=~"{pod}"}}))')
        if stamp is not None:
            found[pool] = stamp
    return found


def _events(helper: ClusterHelper, reason: str) -> list[str]:
    """The messages of the PDService's Events with `reason`, oldest first."""
    events = helper.get_json(
        "events", f"--namespace={NAMESPACE}", f"--field-selector=involvedObject.name={NAME},reason={reason}"
    )["items"]
    return [e["message"] for e in sorted(events, key=lambda e: e.get("lastTimestamp") or "")]
