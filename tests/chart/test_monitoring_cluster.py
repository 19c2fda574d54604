"""Every PromQL expression of the chart's dashboard and rules, run against the local cluster's real Prometheus while
load runs through a PDService's router.

The setup is a user's: the operator (a process, scraped as a static target) reconciles PDService `chat` whose
engines (the simulator, with vLLM's metric names) and router run as pods on the process node, discovered and
scraped by Prometheus through the Kubernetes API with the labels the chart's PodMonitor gives (`namespace`, `pod`,
`pool`, `pdservice`); PDService `broken` names a node path no operator allows, so it is Stalled (InvalidSpec). The
chart's PrometheusRule is loaded into Prometheus as a rule file, so the recording rules and alerts are evaluated
by the real server. Load: a thread streams long (pd route) and short (decode-only) completions through the router
the whole time; once, the prefill engine fails a request (a fallback) and drops its KV side channel (a failed KV
pull on decode).

`chat`'s SLO is chosen so that some alerts must fire and the SLI's bucket join is checked both ways: a 1 ms TTFT
target (no request is that fast: TTFT burns 100x a p99 budget) and an 80 s ITL target (every gap is within it:
ITL burns 0).

The autoscaler is the operator's own (`--prometheus-url`, a 2 s tick), reaching that Prometheus through a TCP
forwarder the test cuts for a few ticks once the load runs, so its query errors are real and
`PDServeAutoscalerQueryErrors` fires (rate() sees the first errors because the counters start at 0). Both of
`chat`'s pools are scaled by pdserve between 1 and 1 replica: every tick decides (the 1 ms TTFT target is
breached, so prefill is held at its maximum: reason AtMaxReplicas) without adding pods. `PDServePoolAtMaxReplicas`
needs 90 % of 15 minutes of decisions at the maximum, longer than this test: its logic is checked by the promtool
unit tests (`data/alerts-test.yaml`), its input (AtMaxReplicas decisions of `chat`'s prefill pool) here.

Every dashboard query must return at least one finite value for `chat`'s namespace; every rule expression, with its
comparisons made `bool` (so that a threshold not crossed still shows the series exist and the joins match), must
return data; the alerts the setup provokes must be active.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from pdserve_dev import dashboard
from pdserve_dev.testing.cluster import ClusterHelper
from pdserve_dev.testing.helm import template
from pdserve_dev.testing.metrics import metric_value, scrape_sync
from pdserve_dev.testing.net import TcpForwarder
from pdserve_dev.testing.operator import OperatorProcess
from pdserve_dev.testing.prometheus import PrometheusHelper, bool_comparisons
from pdserve_dev.testing.wait import wait_for

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "pdserve"
pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SERVICE = "chat"
ENGINE_PORT, ROUTER_PORT = 8000, 8080
LONG = " ".join(f"word{i}" for i in range(300))  # over the 64-token threshold: the pd route
SHORT = "Say hi."  # decode-only


# ------------------------------------------------------------------------------------------------------ load


class Load:
    """A thread streaming completions through the router, long and short prompts in turn, until stopped."""

    def __init__(self, router: str) -> None:
        self.router = router
        self.done = 0
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load", daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=60) as client:
            i = 0
            while not self._stop.is_set():
                i += 1
                # Each long prompt starts differently: none is cached on decode, so each takes the pd route.
                prompt = f"Request {i}. {LONG}" if i % 2 else f"{SHORT} {i}"
                body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 12, "stream": True}
                try:
                    with client.stream("POST", f"{self.router}/v1/completions", json=body) as response:
                        response.read()
                        if response.status_code == 200:
                            self.done += 1
                        else:
                            self.failed.append(f"{response.status_code} {response.text[:200]}")
                except httpx.HTTPError as exc:  # counted; the load goes on (faults are injected on purpose)
                    self.failed.append(repr(exc))

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(90)


# ------------------------------------------------------------------------------------------------------ setup


@dataclass
class Setup:
    namespace: str
    prometheus: PrometheusHelper
    rules_file: str
    rules: list[dict[str, Any]]


def _post(url: str, body: dict[str, Any] | None = None, method: str = "POST") -> int:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method=method)
    with urllib.request.urlopen(request, timeout=60) as response:
        response.read()
        return int(response.status)


def _pdservice(namespace: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "local-sim.yaml").read_text())
    doc["metadata"] = {"name": SERVICE, "namespace": namespace}
    doc["spec"]["decode"]["replicas"] = 1
    doc["spec"]["slo"] = {"ttftMilliseconds": 1, "itlMilliseconds": 80_000, "percentile": 99}
    for pool in ("prefill", "decode"):  # pdserve's autoscaler decides every tick, within 1..1 replicas
        doc["spec"][pool]["autoscaling"] = {"enabled": True, "minReplicas": 1, "maxReplicas": 1}
    return doc


def _broken(namespace: str) -> dict[str, Any]:
    doc = _pdservice(namespace)
    doc["metadata"]["name"] = "broken"
    doc["spec"]["model"]["uri"] = "/mnt/models/tiny-llama"  # a node path this operator does not allow: InvalidSpec
    del doc["spec"]["slo"]
    for pool in ("prefill", "decode"):
        doc["spec"][pool].pop("autoscaling", None)
    return doc


def _rendered_rules() -> list[dict[str, Any]]:
    objects = template(CHART, values={"monitoring.prometheusRule.enabled": True})
    [rule] = [o for o in objects if o["kind"] == "PrometheusRule"]
    groups: list[dict[str, Any]] = rule["spec"]["groups"]
    return groups


def _value(prometheus: PrometheusHelper, promql: str) -> float:
    results = prometheus.values(promql)
    return sum(value for _, value in results)


@pytest.fixture(scope="module")
def setup(
    cluster: ClusterHelper, prometheus: PrometheusHelper, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Setup]:
    if cluster.process_node_workdir is None:
        pytest.skip("the local cluster runs without its process node")
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds" / "pdservice.yaml"))
    cluster.wait_crd_established()
    namespace = cluster.create_namespace("dash")
    rules_file = f"pdserve-{namespace}"
    groups = _rendered_rules()
    log = tmp_path_factory.mktemp("dash") / "operator.log"
    target = urllib.parse.urlsplit(prometheus.url)
    with contextlib.ExitStack() as stack:
        forwarder = stack.enter_context(TcpForwarder((target.hostname or "127.0.0.1", target.port or 9090)))
        stack.callback(cluster.kubectl, "delete", "namespace", namespace, "--wait=false", check=False)
        op = stack.enter_context(
            OperatorProcess(
                cluster.kubeconfig,
                log,
                namespaces=[namespace],
                identity="dash",
                lease_namespace=namespace,
                extra=[
                    f"--prometheus-url={forwarder.url}",
                    "--prometheus-timeout=2",
                    "--autoscaler-interval-seconds=2",
                    "--autoscaler-window-seconds=6",
                ],
            )
        )
        op.wait_ready()
        prometheus.add_target(f"{namespace}-operator", f"127.0.0.1:{op.metrics_port}")
        stack.callback(prometheus.remove_target, f"{namespace}-operator")
        prometheus.load_rules(rules_file, yaml.safe_dump({"groups": groups}, sort_keys=False))
        stack.callback(prometheus.unload_rules, rules_file)

        cluster.apply(json.dumps(_pdservice(namespace)))
        cluster.apply(json.dumps(_broken(namespace)))
        result = cluster.kubectl(
            "wait", "--for=condition=Available", f"pds/{SERVICE}", "-n", namespace, "--timeout=180s", check=False
        )
        if result.returncode != 0:
            pods = cluster.kubectl("get", "pods", "-n", namespace, "-o", "wide", check=False).stdout
            pytest.fail(f"{SERVICE} never became Available\n{pods}\n{op.log_tail()}")
        prometheus.wait_for_targets(f'namespace="{namespace}"', 3, timeout=90)  # prefill, decode, router
        [prefill_ip] = cluster.pod_ips(namespace, "pdserve.io/role=prefill")
        [decode_ip] = cluster.pod_ips(namespace, "pdserve.io/role=decode")
        [router_ip] = cluster.pod_ips(namespace, "pdserve.io/role=router")
        router, prefill = f"http://{router_ip}:{ROUTER_PORT}", f"http://{prefill_ip}:{ENGINE_PORT}"
        decode = f"http://{decode_ip}:{ENGINE_PORT}"

        stack.enter_context(Load(router))
        # A prefill engine that answers 503 once: the router prefills on decode instead (route fallback).
        _post(f"{prefill}/sim/faults", {"fail_next": 1})
        # A prefill engine whose KV side channel is gone: decode's pull fails (vllm:nixl_num_failed_transfers).
        _post(f"{prefill}/sim/faults", {"drop_side_channel": True})
        wait_for(
            lambda: metric_value(scrape_sync(f"{decode}/metrics"), "vllm:nixl_num_failed_transfers_total") >= 1,
            timeout=60,
            message="a failed KV pull on the decode engine",
        )
        _post(f"{prefill}/sim/faults", method="DELETE")

        ns = f'namespace="{namespace}"'
        wait_for(
            lambda: (
                _value(prometheus, f'sum(vllm:nixl_num_failed_transfers_total{{{ns}, pool="decode"}})') >= 1
                and _value(prometheus, f"sum(pdserve_router_fallbacks_total{{{ns}}})") >= 1
                and _value(prometheus, f'sum(pdserve_router_requests_total{{{ns}, route="pd"}})') >= 10
                and bool(prometheus.query(f"pdservice:pdserve_ttft_slo_burn_rate:rate5m{{{ns}}}"))
                and bool(prometheus.query(f'pdserve_pdservice_condition{{{ns}, pdservice="broken"}}'))
                and bool(prometheus.query(f"rate(pdserve_autoscaler_decisions_total{{{ns}}}[30s]) > 0"))
                and bool(prometheus.query(f'pdserve_autoscaler_demand{{{ns}, pool="prefill"}}'))
                and bool(prometheus.query(f'pdserve_autoscaler_observed_latency_seconds{{{ns}, kind="ttft"}}'))
            ),
            timeout=120,
            interval=1,
            message="the load, the fallback, the failed pull, the operator's and autoscaler's series, the rules",
        )
        # Prometheus out of the autoscaler's reach for a few ticks: its queries fail and are counted.
        forwarder.close()
        wait_for(
            lambda: _value(prometheus, f"sum(pdserve_autoscaler_query_errors_total{{{ns}}})") > 0,
            timeout=60,
            interval=1,
            message="the autoscaler's failed queries, scraped",
        )
        forwarder.open()
        wait_for(
            lambda: (
                bool(prometheus.query(f'pdserve_autoscaler_demand{{{ns}, pool="prefill"}}'))
                and bool(prometheus.query(f'pdserve_autoscaler_observed_latency_seconds{{{ns}, kind="ttft"}}'))
            ),
            timeout=90,
            interval=1,
            message="the autoscaler reading Prometheus again (its failures are retried with backoff)",
        )
        yield Setup(namespace, prometheus, rules_file, groups)


# ------------------------------------------------------------------------------------------------------ tests


def _finite(results: list[tuple[dict[str, str], float]]) -> bool:
    return any(math.isfinite(value) for _, value in results)


def test_every_dashboard_query_returns_data(setup: Setup) -> None:
    """Each panel query, as Grafana sends it with namespace = the test's and every PDService and pool, and each
    template variable's query, returns at least one finite value."""
    queries = [
        (title, dashboard.promql(expr, namespace=setup.namespace))
        for title, expr in dashboard.expressions(dashboard.dashboard())
    ]
    queries += [
        (f"variable {name}", dashboard.promql(q, namespace=setup.namespace)) for name, q in dashboard.variable_queries()
    ]
    empty = [f"{title}: {expr}" for title, expr in queries if not _finite(setup.prometheus.values(expr))]
    assert empty == [], "\n".join(empty)


def test_every_rule_expression_returns_data(setup: Setup) -> None:
    """Each recording rule's and alert's expression (comparisons as `bool`) returns series, for the test's
    namespace where its result has one."""
    missing = []
    for group in setup.rules:
        for rule in group["rules"]:
            results = setup.prometheus.values(bool_comparisons(rule["expr"]))
            namespaces = {labels.get("namespace") for labels, _ in results}
            if not results or (namespaces != {None} and setup.namespace not in namespaces):
                missing.append(rule.get("alert") or rule.get("record"))
    assert missing == []


def test_the_rules_evaluate_without_errors(setup: Setup) -> None:
    def evaluated() -> list[dict[str, Any]] | None:
        groups = [g for g in setup.prometheus.rules() if Path(g["file"]).stem == setup.rules_file]
        rules = [rule for g in groups for rule in g["rules"]]
        return rules if len(groups) == len(setup.rules) and all(r["health"] != "unknown" for r in rules) else None

    rules = wait_for(evaluated, timeout=30, message="one evaluation of every rule")
    assert [(r["name"], r["lastError"]) for r in rules if r["health"] != "ok"] == []
    assert len(rules) == sum(len(g["rules"]) for g in setup.rules)


def test_the_provoked_alerts_are_active_and_the_burn_rates_are_exact(setup: Setup) -> None:
    ns = f'namespace="{setup.namespace}"'
    # TTFT: every request is slower than 1 ms, so the share over target is 1 and the burn rate 1 / (1 - 0.99).
    assert setup.prometheus.value(f"pdservice:pdserve_ttft_slo_burn_rate:rate5m{{{ns}}}") == pytest.approx(100)
    # ITL: every gap is within 80 s (the le="80.0" bucket matched the router's spelling): nothing burns.
    assert setup.prometheus.value(f"pdservice:pdserve_itl_slo_burn_rate:rate5m{{{ns}}}") == 0
    expected = {
        ("PDServeTTFTBudgetBurn", SERVICE),
        ("PDServeTTFTBudgetBurnSlow", SERVICE),
        ("PDServiceStalled", "broken"),
        ("PDServeKVTransferFailures", SERVICE),
        ("PDServeAutoscalerQueryErrors", SERVICE),
    }
    # PDServePoolAtMaxReplicas' input (its ratio over 15 minutes is the promtool tests' part): the prefill pool's
    # decisions at its maximum.
    at_max = f'pdserve_autoscaler_decisions_total{{{ns}, pool="prefill", reason="AtMaxReplicas"}}'
    assert (setup.prometheus.value(f"sum({at_max})") or 0) > 0

    def active() -> set[tuple[str, str]]:
        found = set()
        for group in setup.prometheus.rules():
            if Path(group["file"]).stem != setup.rules_file:
                continue
            for rule in group["rules"]:
                for alert in rule.get("alerts", []):
                    labels = alert["labels"]
                    if labels.get("namespace") == setup.namespace and alert["state"] in ("pending", "firing"):
                        found.add((labels["alertname"], labels.get("pdservice", "")))
        return found

    def all_expected() -> set[tuple[str, str]] | None:
        now = active()
        return now if now >= expected else None

    wait_for(all_expected, timeout=60, message=lambda: f"the alerts {sorted(expected)} active (now: {active()})")
