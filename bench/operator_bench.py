"""Operator benchmark: one command, real cluster, real operator process.

    .venv/bin/python bench/operator_bench.py [--runs 20] [--fleet 100]

Uses $PDSERVE_CLUSTER_KUBECONFIG when set, else starts a LocalCluster (kube-apiserver, controllers, scheduler, kwok
with the default 16-node GPU topology) in a temporary directory and stops it at the end.

Measures:
1. Latency from creating a PDService to all of its children existing, p50/p99 over `--runs` runs. Baseline, same
   run: server-side applying the same rendered objects directly (what the operator cannot beat: the API server's
   own create latency for those objects, sent one by one). Printed as a ratio operator/baseline.
2. `--fleet` PDServices created at once: time until all are Available (kwok makes pods Ready), operator RSS (peak
   while converging and at rest), API requests per reconcile pass, and writes per no-op reconcile pass once the
   fleet has settled (must be 0). Baseline, same run: the fleet's rendered objects applied directly (8 concurrent
   clients) until every workload is ready, i.e. the cluster's own speed without the operator.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from pdserve.api.crdgen import custom_resource_definition
from pdserve.api.kubeclient import new_api_client
from pdserve.api.validation import validate
from pdserve_dev.cluster.cluster import LocalCluster
from pdserve_dev.testing.cluster import ClusterHelper
from pdserve_dev.testing.operator import OperatorProcess, ensure_cpu_node
from pdserve_dev.testing.wait import wait_for
from pdserve_operator.kinds import MANAGED, PDSERVICE
from pdserve_operator.kube import KubeApi
from pdserve_operator.render import render

ROOT = Path(__file__).resolve().parents[1]
CPU_NODE_PODS = 250


def small_pds(name: str, namespace: str) -> dict[str, Any]:
    """One prefill, one decode, one router; no GPU/RDMA requests so a fleet of 100 fits the 16 kwok nodes."""
    return {
        "apiVersion": "pdserve.io/v1alpha1",
        "kind": "PDService",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {"name": "tiny", "uri": "hf://org/tiny"},
            # GPU-less engines run vLLM's CPU backend: a host KV buffer and a block size that is a multiple of 32.
            "engine": {"image": "vllm/vllm-openai:v0.32.0", "kvBufferDevice": "cpu", "blockSize": 32},
            "prefill": {"replicas": 1, "gpusPerPod": 0},
            "decode": {"replicas": 1, "gpusPerPod": 0},
            "placement": {"rdma": "off"},
            "router": {"replicas": 1, "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}}},
        },
    }


MANAGED_BY_KIND = {kind.kind: kind for kind in MANAGED}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


@contextmanager
def cluster_helper(workdir: Path) -> Iterator[ClusterHelper]:
    import os

    reuse = os.environ.get("PDSERVE_CLUSTER_KUBECONFIG")
    if reuse:
        yield ClusterHelper(kubeconfig=Path(reuse))
        return
    with LocalCluster(workdir / "cluster", topology="default", process_node=False, log=print) as local:
        yield ClusterHelper.from_cluster(local)


class Children:
    """Counts a PDService's children with raw list requests (8 kinds, by instance label)."""

    def __init__(self, api: KubeApi, namespace: str) -> None:
        self.api, self.namespace = api, namespace

    def count(self, name: str) -> int:
        selector = f"app.kubernetes.io/instance={name}"
        return sum(len(self.api.list(kind.collection_path(self.namespace), kind.kind, selector)) for kind in MANAGED)


def exists(api: KubeApi, path: str, kind: str) -> Callable[[], dict[str, Any]]:
    return lambda: api.get(path, kind)


def create(api: KubeApi, document: dict[str, Any]) -> None:
    api.create_raw(PDSERVICE.collection_path(document["metadata"]["namespace"]), PDSERVICE.kind, document)


def latency_runs(cluster: ClusterHelper, api: KubeApi, namespace: str, runs: int) -> dict[str, float]:
    children = Children(api, namespace)
    operator_times, baseline_times = [], []
    for index in range(runs):
        name = f"lat-{index}"
        document = small_pds(name, namespace)
        objects = render(validate(document))
        # The operator applies the workloads last (after the objects they reference, concurrently with each other):
        # once every workload exists, all children do (checked below, outside the timed window).
        workloads = [o for o in objects if o["kind"] in ("StatefulSet", "Deployment")]
        started = time.perf_counter()
        create(api, document)
        for obj in workloads:
            path = MANAGED_BY_KIND[obj["kind"]].object_path(namespace, obj["metadata"]["name"])
            wait_for(exists(api, path, obj["kind"]), 60, interval=0.005)
        operator_times.append(time.perf_counter() - started)
        assert children.count(name) == len(objects), f"{name}: not every child was created"

        # Baseline: the same objects (renamed, no owner) applied directly by one client, one by one.
        base = small_pds(f"base-{index}", namespace)
        objects = render(validate(base))
        started = time.perf_counter()
        for obj in objects:
            api.apply(obj)
        baseline_times.append(time.perf_counter() - started)
    return {
        "operator_p50_s": statistics.median(operator_times),
        "operator_p99_s": percentile(operator_times, 99),
        "baseline_p50_s": statistics.median(baseline_times),
        "baseline_p99_s": percentile(baseline_times, 99),
    }


def available_count(api: KubeApi, namespace: str, prefix: str) -> int:
    items = api.list(PDSERVICE.collection_path(namespace), PDSERVICE.kind)
    count = 0
    for item in items:
        if not item["metadata"]["name"].startswith(prefix):
            continue
        for condition in (item.get("status") or {}).get("conditions") or []:
            if condition["type"] == "Available" and condition["status"] == "True":
                count += 1
    return count


def workloads_ready(api: KubeApi, namespace: str, prefix: str) -> int:
    """Ready workloads (StatefulSets and Deployments with every replica ready) whose name starts with `prefix`."""
    ready = 0
    for kind in (MANAGED_BY_KIND["StatefulSet"], MANAGED_BY_KIND["Deployment"]):
        for item in api.list(kind.collection_path(namespace), kind.kind):
            if not item["metadata"]["name"].startswith(prefix):
                continue
            want = item["spec"].get("replicas", 1)
            status = item.get("status") or {}
            have = status.get("readyReplicas", 0) if kind.kind == "StatefulSet" else status.get("availableReplicas", 0)
            ready += int(have >= want and status.get("observedGeneration", 0) >= item["metadata"]["generation"])
    return ready


def baseline_fleet(api: KubeApi, namespace: str, size: int) -> float:
    """The same fleet without the operator: its rendered objects applied directly by 8 concurrent clients (as the
    operator does), timed until every workload is ready. What is left is the cluster's own speed."""
    objects = []
    for index in range(size):
        objects += render(validate(small_pds(f"bfleet-{index}", namespace)))
    workloads = [o for o in objects if o["kind"] in ("StatefulSet", "Deployment")]
    others = [o for o in objects if o["kind"] not in ("StatefulSet", "Deployment")]
    started = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(api.apply, others))
        list(pool.map(api.apply, workloads))
    wait_for(lambda: workloads_ready(api, namespace, "bfleet-") >= len(workloads), 900, interval=1)
    return time.perf_counter() - started


def fleet_run(api: KubeApi, operator: OperatorProcess, namespace: str, size: int) -> dict[str, float]:
    before = operator.metrics()
    peak_rss = operator.rss_bytes()
    stop = threading.Event()

    def sample_rss() -> None:
        nonlocal peak_rss
        while not stop.is_set():
            peak_rss = max(peak_rss, operator.rss_bytes())
            time.sleep(0.5)

    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()
    started = time.perf_counter()
    for index in range(size):
        create(api, small_pds(f"fleet-{index}", namespace))
    wait_for(lambda: available_count(api, namespace, "fleet-") >= size, 900, interval=1)
    all_available = time.perf_counter() - started
    stop.set()
    sampler.join()
    converged = operator.metrics()

    def delta(prefix: str, a: dict[str, float], b: dict[str, float]) -> float:
        # Lease traffic (renewals every retry period) is leader election, not reconciling: left out.
        def total(samples: dict[str, float]) -> float:
            return sum(v for k, v in samples.items() if k.startswith(prefix) and 'kind="Lease"' not in k)

        return total(b) - total(a)

    reconciles = delta("pdserve_operator_reconciles_total{", before, converged)
    requests = delta("pdserve_operator_api_requests_total{", before, converged)
    writes = delta("pdserve_operator_writes_total{", before, converged)

    # Settle, then watch at least two full resyncs of the whole fleet: every pass must be a no-op.
    time.sleep(5)
    rest_before = operator.metrics()
    time.sleep(25)
    rest_after = operator.metrics()
    noop_passes = delta('pdserve_operator_reconciles_total{result="noop"}', rest_before, rest_after)
    rest_passes = delta("pdserve_operator_reconciles_total{", rest_before, rest_after)
    rest_writes = delta("pdserve_operator_writes_total{", rest_before, rest_after)
    rest_requests = delta("pdserve_operator_api_requests_total{", rest_before, rest_after)
    return {
        "fleet_size": size,
        "all_available_s": all_available,
        "reconcile_passes_to_converge": reconciles,
        "api_requests_per_reconcile": requests / max(reconciles, 1),
        "writes_per_reconcile_converging": writes / max(reconciles, 1),
        "writes_per_pdservice": writes / size,
        "rest_reconcile_passes": rest_passes,
        "rest_noop_passes": noop_passes,
        "writes_per_noop_reconcile": rest_writes / max(noop_passes, 1),
        "api_requests_per_noop_reconcile": rest_requests / max(noop_passes, 1),
        "operator_rss_peak_mib": peak_rss / 2**20,
        "operator_rss_rest_mib": operator.rss_bytes() / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="Latency runs.")
    parser.add_argument("--fleet", type=int, default=100, help="PDServices created at once.")
    parser.add_argument("--json", type=Path, help="Also write the results here.")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="pdserve-operator-bench-") as tmp, cluster_helper(Path(tmp)) as cluster:
        crd = yaml.safe_dump(custom_resource_definition())
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=crd)
        cluster.kubectl("wait", "--for=condition=Established", "crd/pdservices.pdserve.io", "--timeout=60s")
        ensure_cpu_node(cluster, name="pdserve-operator-bench-cpu", pods=CPU_NODE_PODS, cidr="10.250.251.0/24")
        namespace = cluster.create_namespace("bench-op")
        api = KubeApi(new_api_client(cluster.kubeconfig))
        operator = OperatorProcess(
            cluster.kubeconfig,
            Path(tmp) / "operator.log",
            namespaces=[namespace],
            identity=f"bench-{uuid.uuid4().hex[:6]}",
            lease_name=f"bench-{namespace}",
            lease_namespace=namespace,
            extra=["--resync-seconds", "10", "--relist-seconds", "3600", "--log-level", "warning"],
        )
        try:
            operator.start().wait_ready()
            latency = latency_runs(cluster, api, namespace, args.runs)
            fleet = fleet_run(api, operator, namespace, args.fleet)
            fleet["baseline_all_ready_s"] = baseline_fleet(api, namespace, args.fleet)
            fleet["all_available_over_baseline"] = fleet["all_available_s"] / fleet["baseline_all_ready_s"]
        except BaseException:
            print(operator.log_tail(), file=sys.stderr)
            raise
        finally:
            operator.stop()
            cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)

    results = {**latency, **fleet}
    results["operator_over_baseline_p50"] = latency["operator_p50_s"] / latency["baseline_p50_s"]
    results["operator_over_baseline_p99"] = latency["operator_p99_s"] / latency["baseline_p99_s"]
    print(f"apply -> all children created over {args.runs} runs:")
    print(
        f"  operator  p50 {latency['operator_p50_s'] * 1000:7.1f} ms   p99 {latency['operator_p99_s'] * 1000:7.1f} ms"
    )
    print(
        f"  baseline  p50 {latency['baseline_p50_s'] * 1000:7.1f} ms   p99 {latency['baseline_p99_s'] * 1000:7.1f} ms"
    )
    ratio50, ratio99 = results["operator_over_baseline_p50"], results["operator_over_baseline_p99"]
    print(f"  ratio     p50 {ratio50:.2f}x  p99 {ratio99:.2f}x  (baseline: one client applying the rendered objects)")
    print(f"{args.fleet} PDServices at once:")
    for key, value in fleet.items():
        print(f"  {key:34s} {value:10.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if fleet["writes_per_noop_reconcile"] != 0:
        raise SystemExit("FAIL: no-op reconciles wrote to the API")


if __name__ == "__main__":
    main()
