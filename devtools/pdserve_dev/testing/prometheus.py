"""Query the local cluster's real Prometheus from tests, the demo and benchmarks.

`PrometheusHelper` wraps `prometheus-api-client` (what the autoscaler uses too) with the few things tests need:
start or attach to a cluster's Prometheus, `query(promql)`, `wait_for_targets(selector, count)`, static
targets for processes outside the cluster (the operator run as a host process), and rule files (`load_rules`,
`rules`, `alerts`: the chart's alerts evaluated by the real server). Waiting polls `up`, never
sleeps: the first scrape lands 5-10 s after Prometheus starts, later ones every second.

Target labels of pdserve pods (`pdserve_dev.cluster.prometheus.TARGET_LABELS`): `namespace`, `pod`, `pool`
(prefill, decode, router) and `pdservice`.
"""

from __future__ import annotations

import json
import os
import re
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_api_client import PrometheusConnect

from pdserve_dev.cluster import prometheus as prometheus_mod
from pdserve_dev.cluster.cluster import ClusterState, LocalCluster
from pdserve_dev.testing.wait import wait_for

# Comparison operators outside label matchers and strings, not already `bool` ones.
_MATCHERS_AND_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\{[^}]*\}')
_COMPARISON = re.compile(r"(==|!=|>=|<=|>(?!=)|<(?!=))(?!\s*bool\b)")

URL_ENV = "PDSERVE_PROMETHEUS_URL"
"""An already running Prometheus to attach to (`pdserve dev cluster env` prints it)."""


def bool_comparisons(expr: str) -> str:
    """`expr` with every comparison made a `bool` comparison (`x > 0` -> `x > bool 0`).

    An alert's expression returns nothing while its threshold is not crossed; with `bool` it returns 0 or 1 for
    every series its operands have, so a test can check that the series exist and the joins match without
    provoking every alert. Label matchers (`{a!="b"}`) and strings are left alone."""
    out, last = [], 0
    for skipped in _MATCHERS_AND_STRINGS.finditer(expr):
        out.append(_COMPARISON.sub(r"\1 bool", expr[last : skipped.start()]))
        out.append(skipped.group())
        last = skipped.end()
    out.append(_COMPARISON.sub(r"\1 bool", expr[last:]))
    return "".join(out)


@dataclass
class PrometheusHelper:
    """A running Prometheus: its URL, PromQL queries, target waits, static targets."""

    url: str
    file_sd_dir: Path | None = None
    """Where `add_target` writes file_sd files (None when attached to a Prometheus we do not manage)."""
    rules_dir: Path | None = None
    """Where `load_rules` writes rule files (None when attached to a Prometheus we do not manage)."""
    client: PrometheusConnect = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.client = PrometheusConnect(url=self.url, disable_ssl=True)

    # -- construction --------------------------------------------------------------------------------------

    @classmethod
    def for_cluster(cls, local: LocalCluster, timeout: float = 60.0) -> PrometheusHelper:
        """The Prometheus of a LocalCluster, started (and built) if it does not run yet; it stops with the cluster."""
        url = local.start_prometheus(timeout)
        return cls(url, local.prometheus_paths.file_sd, local.prometheus_paths.rules)

    @classmethod
    def for_workdir(cls, workdir: Path, timeout: float = 60.0) -> PrometheusHelper:
        """The Prometheus of the cluster `pdserve dev cluster up` keeps in `workdir`, started if it lacks one."""
        return cls.for_cluster(LocalCluster.attach(workdir), timeout)

    @classmethod
    def from_environment(cls, kubeconfig: Path) -> PrometheusHelper:
        """For a reused cluster: `$PDSERVE_PROMETHEUS_URL`, else the Prometheus of the workdir holding `kubeconfig`."""
        url = os.environ.get(URL_ENV)
        if url:
            return cls(url.rstrip("/"))
        workdir = kubeconfig.parent
        if ClusterState.load(workdir) is None:
            raise RuntimeError(
                f"No Prometheus for the cluster of {kubeconfig}: set {URL_ENV} or start the cluster with "
                "`pdserve dev cluster up --prometheus`"
            )
        return cls.for_workdir(workdir)

    # -- queries -------------------------------------------------------------------------------------------

    def ready(self) -> bool:
        return prometheus_mod.ready(self.url)

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query; each result is `{"metric": {labels}, "value": [time, "value"]}` (vector results)."""
        result: list[dict[str, Any]] = self.client.custom_query(promql)
        return result

    def values(self, promql: str) -> list[tuple[dict[str, str], float]]:
        """An instant query as (labels, value) pairs."""
        return [(dict(r["metric"]), float(r["value"][1])) for r in self.query(promql)]

    def value(self, promql: str) -> float | None:
        """The single value of a query that returns at most one series (None when it returns none)."""
        results = self.values(promql)
        if len(results) > 1:
            raise AssertionError(f"{promql} returned {len(results)} series, expected at most one: {results}")
        return results[0][1] if results else None

    def targets(self) -> list[dict[str, Any]]:
        """Prometheus' active targets, each with `labels`, `health`, `lastError`, `scrapeUrl`, ..."""
        active: list[dict[str, Any]] = self.client.get_targets(state="active")["activeTargets"]
        return active

    def wait_for_targets(self, selector: str, count: int, timeout: float = 60.0) -> list[dict[str, str]]:
        """Wait until exactly `count` targets matching `selector` are up; return their labels.

        `selector` is the inside of a PromQL label selector, e.g. `pool="decode", namespace="ns"` or
        `job="pdserve-operator"`. Polls `up{selector} == 1`: a target counts once it was scraped successfully,
        and stops counting once it is gone (its series went stale) or failed its last scrape.
        """
        query = f"up{{{selector}}} == 1"

        def settled() -> list[dict[str, str]] | None:
            found = [labels for labels, _ in self.values(query)]
            return found if len(found) == count else None

        def describe() -> str:
            try:
                seen = [labels.get("pod") or labels.get("instance") for labels, _ in self.values(query)]
            except Exception as exc:  # only for the message
                seen = [repr(exc)]
            return f"{count} targets with {query} (now: {seen})"

        return wait_for(settled, timeout=timeout, interval=0.5, message=describe)

    # -- static targets ------------------------------------------------------------------------------------

    def add_target(self, job: str, address: str, labels: Mapping[str, str] | None = None) -> None:
        """Scrape `address` (host:port, /metrics) as job `job`, e.g. the operator's metrics port."""
        if self.file_sd_dir is None:
            raise RuntimeError(f"Prometheus at {self.url} is not managed here; cannot add targets to it")
        prometheus_mod.add_static_target(self.file_sd_dir, job, address, labels)

    def remove_target(self, job: str) -> None:
        if self.file_sd_dir is not None:
            prometheus_mod.remove_static_target(self.file_sd_dir, job)

    # -- rules ---------------------------------------------------------------------------------------------

    def load_rules(self, name: str, text: str) -> None:
        """Write rule file `name` (Prometheus' rule file format) and reload: its groups evaluate from now on, every
        evaluation interval (1 s here). Raises when Prometheus refuses the file."""
        if self.rules_dir is None:
            raise RuntimeError(f"Prometheus at {self.url} is not managed here; cannot load rules into it")
        prometheus_mod.add_rule_file(self.rules_dir, name, text)
        try:
            prometheus_mod.reload(self.url)
        except RuntimeError:
            prometheus_mod.remove_rule_file(self.rules_dir, name)  # leave the server loadable for the next test
            raise

    def unload_rules(self, name: str) -> None:
        if self.rules_dir is not None:
            prometheus_mod.remove_rule_file(self.rules_dir, name)
            prometheus_mod.reload(self.url)

    def rules(self) -> list[dict[str, Any]]:
        """Every loaded rule group (/api/v1/rules): `name`, `file` and `rules`, each rule with `name`, `query`,
        `health`, `lastError`, and for alerts `state` and the active `alerts`."""
        # prometheus-api-client has no call for it.
        with urllib.request.urlopen(f"{self.url}/api/v1/rules", timeout=30) as response:
            groups: list[dict[str, Any]] = json.loads(response.read())["data"]["groups"]
        return groups
