"""The local cluster's real Prometheus finds pdserve's pods through the API server, scrapes them, forgets them.

A PDService (examples/local-sim.yaml: the engines run as simulators on the process node, the router is the real
one) is applied with the operator running as a host process; Prometheus discovers the pods with its own
read-only identity and the operator through a static target the harness adds. Then a decode replica is removed
and its series must leave instant queries, which is what lets the autoscaler count only live pods.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from pdserve_dev.cluster import build, versions
from pdserve_dev.cluster import prometheus as prom
from pdserve_dev.cluster.cluster import LocalCluster
from pdserve_dev.cluster.processes import process_start_time, tracked_processes
from pdserve_dev.testing.cluster import ClusterHelper
from pdserve_dev.testing.net import listening
from pdserve_dev.testing.operator import OperatorProcess
from pdserve_dev.testing.prometheus import PrometheusHelper
from pdserve_dev.testing.wait import wait_for

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.cluster, pytest.mark.slow]

STALE_WITHIN = 60.0
"""Seconds a removed pod's series may stay visible after the pod is gone. Prometheus writes staleness markers
when a target leaves discovery (updates come every 5 s, scrapes every second); without them a series stays
in instant queries for the 5-minute lookback, so 60 s separates working from broken with a wide margin."""


@pytest.fixture(scope="module")
def namespace(cluster: ClusterHelper) -> Iterator[str]:
    if cluster.process_node_workdir is None:
        pytest.skip("the local cluster runs without its process node")
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds" / "pdservice.yaml"))
    cluster.wait_crd_established()
    name = cluster.create_namespace("prom")
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def operator(
    cluster: ClusterHelper, namespace: str, prometheus: PrometheusHelper, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    """The operator as a host process, scraped through a static target; examples/local-sim.yaml applied."""
    log = tmp_path_factory.mktemp("prom") / "operator.log"
    with OperatorProcess(
        cluster.kubeconfig, log, namespaces=[namespace], identity="prom", lease_namespace=namespace
    ) as op:
        op.wait_ready()
        prometheus.add_target("pdserve-operator", f"127.0.0.1:{op.metrics_port}", {"namespace": namespace})
        doc = yaml.safe_load((ROOT / "examples" / "local-sim.yaml").read_text())
        doc["metadata"]["namespace"] = namespace
        cluster.apply(json.dumps(doc))
        try:
            cluster.kubectl(
                "wait", "--for=condition=Available", "pds/demo", "-n", namespace, "--timeout=180s", timeout=200
            )
            yield op
        finally:
            prometheus.remove_target("pdserve-operator")


def _selector(namespace: str, **labels: str) -> str:
    return ", ".join(f'{k}="{v}"' for k, v in {"namespace": namespace, "pdservice": "demo", **labels}.items())


def test_engine_and_router_pods_are_discovered_with_their_pool(
    prometheus: PrometheusHelper, operator: OperatorProcess, namespace: str
) -> None:
    # local-sim.yaml: one prefill, two decode engines, one router.
    targets = prometheus.wait_for_targets(_selector(namespace), 4, timeout=180)
    pools = sorted((t["pool"], t["pod"]) for t in targets)
    assert pools == [
        ("decode", "demo-decode-0"),
        ("decode", "demo-decode-1"),
        ("prefill", "demo-prefill-0"),
        ("router", pools[3][1]),
    ]
    assert pools[3][1].startswith("demo-router-")
    assert {t["job"] for t in targets} == {"pdserve-pods"}
    # Scraped on the `http` port only (not the engines' NIXL side channel): one target per pod.
    scraped = [
        t for t in prometheus.targets() if t["scrapePool"] == "pdserve-pods" and t["labels"]["namespace"] == namespace
    ]
    assert len(scraped) == 4
    assert all(t["scrapeUrl"].endswith(":8000/metrics") for t in scraped if t["labels"]["pool"] != "router")


def test_simulator_and_router_metrics_carry_pool_and_pdservice(
    prometheus: PrometheusHelper, operator: OperatorProcess, namespace: str, cluster: ClusterHelper
) -> None:
    prometheus.wait_for_targets(_selector(namespace), 4, timeout=180)
    running = prometheus.values(f"vllm:num_requests_running{{{_selector(namespace, pool='decode')}}}")
    assert sorted(labels["pod"] for labels, _ in running) == ["demo-decode-0", "demo-decode-1"]
    # The router's own per-endpoint `role` label survives: the pod's role is the target label `pool`.
    endpoints = prometheus.values(f"pdserve_router_endpoint_up{{{_selector(namespace, pool='router')}}}")
    assert sorted(labels["role"] for labels, _ in endpoints) == ["decode", "decode", "prefill"]
    assert not any("exported_role" in labels for labels, _ in endpoints)

    # A request through the router shows up as a counted success of one decode engine of this PDService.
    [router_ip] = cluster.pod_ips(namespace, "pdserve.io/role=router")
    body = {"model": "tiny-llama", "prompt": "hello " * 100, "max_tokens": 4}
    request = urllib.request.Request(
        f"http://{router_ip}:8080/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
    query = f"sum(vllm:request_success_total{{{_selector(namespace, pool='decode')}}})"
    assert wait_for(lambda: prometheus.value(query), timeout=30) == 1.0


def test_the_operator_is_scraped_through_its_static_target(
    prometheus: PrometheusHelper, operator: OperatorProcess, namespace: str
) -> None:
    [target] = prometheus.wait_for_targets(f'job="pdserve-operator", namespace="{namespace}"', 1)
    assert target["instance"] == f"127.0.0.1:{operator.metrics_port}"
    leader = f'pdserve_operator_leader{{job="pdserve-operator", namespace="{namespace}"}}'
    assert wait_for(lambda: prometheus.value(leader), timeout=30) == 1.0


def test_a_removed_replica_leaves_instant_queries(
    prometheus: PrometheusHelper, operator: OperatorProcess, namespace: str, cluster: ClusterHelper
) -> None:
    gone = _selector(namespace, pod="demo-decode-1")
    prometheus.wait_for_targets(_selector(namespace, pool="decode"), 2, timeout=180)
    assert prometheus.values(f"vllm:kv_cache_usage_perc{{{gone}}}")

    cluster.kubectl("patch", "pds/demo", "-n", namespace, "--type=merge", "-p", '{"spec":{"decode":{"replicas":1}}}')
    wait_for(
        lambda: [p["metadata"]["name"] for p in cluster.pods(namespace, "pdserve.io/role=decode")] == ["demo-decode-0"],
        timeout=120,
        message="demo-decode-1 to be deleted",
    )
    # Counted: exactly one decode target is up again, the remaining replica.
    [kept] = prometheus.wait_for_targets(_selector(namespace, pool="decode"), 1, timeout=STALE_WITHIN)
    assert kept["pod"] == "demo-decode-0"
    wait_for(
        lambda: prometheus.query(f"vllm:kv_cache_usage_perc{{{gone}}} or up{{{gone}}}") == [],
        timeout=STALE_WITHIN,
        message="the removed replica's series to go stale",
    )
    assert prometheus.values(f"vllm:kv_cache_usage_perc{{{_selector(namespace, pool='decode')}}}")[0][0]["pod"] == (
        "demo-decode-0"
    )


def test_promtool_accepts_the_rendered_config(tmp_path: Path) -> None:
    paths = prom.PrometheusPaths(tmp_path)
    kubeconfig = tmp_path / "prometheus.kubeconfig"
    kubeconfig.write_text("apiVersion: v1\nkind: Config\nclusters: []\nusers: []\ncontexts: []\n")
    prom.write_config(paths, kubeconfig)
    check = subprocess.run(
        [str(build.binary("promtool")), "check", "config", str(paths.config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS" in check.stdout


OWNER = """
import sys, time
from pdserve_dev.cluster import build, versions
from pdserve_dev.cluster import prometheus as prom
from pdserve_dev.cluster.cluster import LocalCluster
cluster = LocalCluster(sys.argv[1], topology="minimal", process_node=False, prometheus=True).start()
print("READY", cluster.prometheus_url, flush=True)
time.sleep(600)
"""


def test_prometheus_dies_with_a_killed_cluster_owner(tmp_path: Path) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert owner.stdout is not None
        first = owner.stdout.readline()
        assert first.startswith("READY "), first + owner.stdout.read()
        url = first.split()[1]
        [prometheus] = [t for t in tracked_processes(tmp_path / "pids") if t.name == "prometheus"]
        assert PrometheusHelper(url).ready()
        owner.kill()
        owner.wait(timeout=30)
        wait_for(lambda: process_start_time(prometheus.pid) is None, timeout=20, message="prometheus to exit")
        port = int(url.rsplit(":", 1)[1])
        wait_for(lambda: not listening(port), timeout=20, message="prometheus' port to close")
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


def _pdserve(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "dev", "cluster", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def test_cli_up_adds_prometheus_status_shows_it_and_down_stops_it(tmp_path: Path) -> None:
    where = ["--workdir", str(tmp_path / "cli-cluster")]
    try:
        up = _pdserve("up", *where, "--topology", "minimal", "--no-process-node")
        assert up.returncode == 0, up.stdout + up.stderr
        assert "Prometheus" not in up.stdout
        # `--prometheus` on the running cluster adds Prometheus to it.
        again = _pdserve("up", *where, "--topology", "minimal", "--no-process-node", "--prometheus")
        assert again.returncode == 0, again.stdout + again.stderr
        assert "already running" in again.stdout and "Started Prometheus at http://127.0.0.1:" in again.stdout

        status = _pdserve("status", *where, "--json")
        assert status.returncode == 0, status.stdout + status.stderr
        info = json.loads(status.stdout)
        assert info["prometheus"]["ready"] is True
        url = info["prometheus"]["url"]
        assert PrometheusHelper(url).ready()
        [pid] = [c["pid"] for c in info["components"] if c["name"] == "prometheus"]
        text = _pdserve("status", *where).stdout
        assert f"prometheus: {url} (ready)" in text
        env = _pdserve("env", *where).stdout
        assert f"export PDSERVE_PROMETHEUS_URL={url}" in env
        assert f"{build.bin_dir(toolset=versions.PROMETHEUS)}:" in env
        # Attaching again (another `up --prometheus`, a test session reusing the cluster) finds the running one.
        third = _pdserve("up", *where, "--topology", "minimal", "--no-process-node", "--prometheus")
        assert third.returncode == 0 and "Started Prometheus" not in third.stdout
        assert PrometheusHelper.for_workdir(tmp_path / "cli-cluster").url == url
        assert [c["name"] for c in json.loads(_pdserve("status", *where, "--json").stdout)["components"]].count(
            "prometheus"
        ) == 1
    finally:
        down = _pdserve("down", *where)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "prometheus" in down.stdout
    assert process_start_time(pid) is None
    assert not listening(int(url.rsplit(":", 1)[1]))
    assert "NOT READY" in _pdserve("status", *where).stdout


def test_prometheus_stops_with_the_cluster(tmp_path: Path) -> None:
    with LocalCluster(tmp_path, topology="minimal", process_node=False) as local:
        helper = PrometheusHelper.for_cluster(local)  # started after the cluster, as the test fixture does
        assert helper.ready()
        assert helper.value('count(up{job="pdserve-pods"})') is None  # no pdserve pods, no targets
        [prometheus] = [t for t in tracked_processes(tmp_path / "pids") if t.name == "prometheus"]
        assert local.start_prometheus() == helper.url  # idempotent
    assert process_start_time(prometheus.pid) is None
    assert not listening(int(helper.url.rsplit(":", 1)[1]))
