"""Operator benchmark: one command, real cluster, real operator process.

    .venv/bin/python bench/operator_bench.py [--runs 20] [--fleet 100] [--timeout 300] [--operator-log FILE]

Uses $PDSERVE_CLUSTER_KUBECONFIG when set, else starts a LocalCluster (kube-apiserver, controllers, scheduler, kwok
with the default 16-node GPU topology) in a temporary directory and stops it at the end. Every pod the run creates
(3 per PDService: 2 x runs + 2 x fleet of them, nothing is deleted before the end) fits on one untainted kwok CPU
node sized for the run (routers tolerate no GPU taint; engines request no GPU and may land on it too). Every wait
ends after --timeout seconds with a diagnosis (pods by phase and the scheduler's messages, PDServices that are not
Available and why, the operator's log) and exit status 1: the benchmark fails, it never hangs.

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
import collections
import ipaddress
import json
import math
import shutil
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
from kubernetes import client as k8s
from kubernetes import watch

from pdserve.api.crdgen import custom_resource_definition
from pdserve.api.kubeclient import new_api_client
from pdserve.api.validation import validate
from pdserve_dev.cluster.cluster import LocalCluster
from pdserve_dev.testing.cluster import ClusterHelper
from pdserve_dev.testing.operator import OperatorProcess, ensure_cpu_node
from pdserve_dev.testing.wait import WaitTimeoutError, wait_for
from pdserve_operator.kinds import MANAGED, PDSERVICE, POD
from pdserve_operator.kube import KubeApi
from pdserve_operator.render import render

ROOT = Path(__file__).resolve().parents[1]
PODS_PER_PDSERVICE = 3  # one prefill, one decode, one router
# Pod addresses of the bench's CPU node (kwok hands them out of the node's podCIDR): clear of the operator tests'
# CPU nodes (10.250.x.0/24) and of the cluster's own ranges.
CPU_NODE_NETWORK = ipaddress.ip_network("10.128.0.0/10")


class BenchTimeoutError(Exception):
    """A phase did not finish within --timeout; the message says what was still missing and why."""


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


def cpu_node_for(runs: int, fleet: int) -> tuple[str, int, str]:
    """Name, pod capacity and podCIDR of a CPU node that holds every pod of the run, with room to spare.

    The benchmark used to add a fixed 250-pod node: `--runs 20 --fleet 100` puts 240 routers there, and with the
    few engines the scheduler also spread onto it the last routers of the baseline fleet stayed Pending, and the
    benchmark waited 900 s for them (the "stall"). The name carries the capacity so that a reused cluster gets a
    bigger node when a run needs one."""
    pods = PODS_PER_PDSERVICE * (2 * (runs + fleet) + 1) + 50  # + the warm-up PDService
    prefix = 32 - math.ceil(math.log2(pods + 2))
    cidr = next(CPU_NODE_NETWORK.subnets(new_prefix=prefix))
    return f"pdserve-operator-bench-cpu-{pods}", pods, str(cidr)


def diagnose(api: KubeApi, namespace: str, prefix: str) -> str:
    """What a timed-out phase was waiting for: pods by phase with the scheduler's and kubelet's reasons, and the
    PDServices named `prefix*` that are not Available with their conditions."""
    lines = []
    pods = [p for p in api.list(POD.collection_path(namespace), POD.kind) if p["metadata"]["name"].startswith(prefix)]
    phases = collections.Counter((p.get("status") or {}).get("phase", "Unknown") for p in pods)
    lines.append(f"pods {prefix}*: {dict(phases)}")
    reasons: collections.Counter[str] = collections.Counter()
    for pod in pods:
        for condition in (pod.get("status") or {}).get("conditions") or []:
            if condition.get("status") == "False" and condition.get("message"):
                reasons[f"{condition['type']}: {condition['message']}"] += 1
    lines += [f"  {count} x {reason}" for reason, count in reasons.most_common(5)]
    waiting = []
    for item in api.list(PDSERVICE.collection_path(namespace), PDSERVICE.kind):
        if not item["metadata"]["name"].startswith(prefix):
            continue
        conditions = {c["type"]: c for c in (item.get("status") or {}).get("conditions") or []}
        if conditions.get("Available", {}).get("status") != "True":
            shown = [f"{t}={c['status']}/{c['reason']}: {c.get('message', '')}" for t, c in conditions.items()]
            waiting.append(f"  {item['metadata']['name']}: " + ("; ".join(shown) or "no status yet"))
    if waiting:
        lines.append(f"{len(waiting)} PDServices not Available, e.g.:")
        lines += waiting[:5]
    return "\n".join(lines)


def wait_phase(
    what: str, predicate: Callable[[], Any], timeout: float, *, api: KubeApi, namespace: str, prefix: str
) -> None:
    """`wait_for` that fails the benchmark with a diagnosis instead of waiting on."""
    try:
        wait_for(predicate, timeout, interval=1)
    except WaitTimeoutError as exc:
        diagnosis = diagnose(api, namespace, prefix)
        raise BenchTimeoutError(f"{what}: not done after {timeout:.0f}s ({exc})\n{diagnosis}") from None


def wait_workloads_created(apps: k8s.AppsV1Api, namespace: str, name: str, timeout: float) -> None:
    """Block until the PDService's two StatefulSets and its Deployment exist: a list, then a watch from the list's
    resourceVersion (the event arrives when the object is created; no polling that would compete with the
    operator for the CPU)."""
    selector = f"app.kubernetes.io/instance={name}"
    deadline = time.monotonic() + timeout
    for lister, want in ((apps.list_namespaced_stateful_set, 2), (apps.list_namespaced_deployment, 1)):
        listed = lister(namespace, label_selector=selector)
        assert listed.metadata is not None
        seen = {item.metadata.name for item in listed.items if item.metadata is not None}
        version = listed.metadata.resource_version
        while len(seen) < want:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchTimeoutError(f"{name}: {len(seen)}/{want} {lister.__name__} objects after {timeout:.0f}s")
            stream = watch.Watch().stream(  # type: ignore[no-untyped-call]
                lister, namespace, label_selector=selector, resource_version=version, timeout_seconds=max(1, int(left))
            )
            for event in stream:
                version = event["object"].metadata.resource_version
                if event["type"] == "ADDED":
                    seen.add(event["object"].metadata.name)
                    if len(seen) >= want:
                        break


def create(api: KubeApi, document: dict[str, Any]) -> None:
    api.create_raw(PDSERVICE.collection_path(document["metadata"]["namespace"]), PDSERVICE.kind, document)


def latency_runs(api: KubeApi, apps: k8s.AppsV1Api, namespace: str, runs: int, timeout: float) -> dict[str, Any]:
    children = Children(api, namespace)
    operator_times, baseline_times = [], []
    for index in range(runs):
        name = f"lat-{index}"
        document = small_pds(name, namespace)
        objects = render(validate(document))
        # The operator applies the workloads last (after the objects they reference, concurrently with each other):
        # once every workload exists, all children do (checked below, outside the timed window).
        started = time.perf_counter()
        create(api, document)
        wait_workloads_created(apps, namespace, name, timeout)
        operator_times.append(time.perf_counter() - started)
        if children.count(name) != len(objects):
            raise SystemExit(f"FAIL: {name}: not every child was created")

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
        "operator_runs_s": operator_times,
        "baseline_runs_s": baseline_times,
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


def baseline_fleet(api: KubeApi, namespace: str, size: int, timeout: float) -> float:
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
    wait_phase(
        f"baseline fleet: {len(workloads)} workloads ready",
        lambda: workloads_ready(api, namespace, "bfleet-") >= len(workloads),
        timeout,
        api=api,
        namespace=namespace,
        prefix="bfleet-",
    )
    return time.perf_counter() - started


def fleet_run(api: KubeApi, operator: OperatorProcess, namespace: str, size: int, timeout: float) -> dict[str, float]:
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
    try:
        wait_phase(
            f"operator fleet: {size} PDServices Available",
            lambda: available_count(api, namespace, "fleet-") >= size,
            timeout,
            api=api,
            namespace=namespace,
            prefix="fleet-",
        )
    finally:
        stop.set()
        sampler.join()
    all_available = time.perf_counter() - started
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
        # urllib3 discarding connections of a pool too small for the operator's threads (a TLS handshake each).
        "operator_pool_full_warnings": operator.log_path.read_text(errors="replace").count("Connection pool is full"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="Latency runs.")
    parser.add_argument("--fleet", type=int, default=100, help="PDServices created at once.")
    parser.add_argument("--json", type=Path, help="Also write the results here.")
    parser.add_argument(
        "--timeout",
        type=float,
        help="Seconds a fleet phase may take before the benchmark fails [default: 300 + 2 per fleet PDService]; "
        "one latency run may take a tenth of it.",
    )
    parser.add_argument(
        "--max-p99-ratio", type=float, default=2.0, help="Fail when operator p99 exceeds baseline p99 this many times."
    )
    parser.add_argument("--operator-log", type=Path, help="Keep the operator's log here.")
    parser.add_argument(
        "--operator-log-level", choices=["debug", "info", "warning"], default="warning", help="The operator's."
    )
    args = parser.parse_args()
    if args.timeout is None:
        args.timeout = 300.0 + 2.0 * args.fleet
    try:
        latency, fleet = bench(args)
    except BenchTimeoutError as exc:
        raise SystemExit(f"FAIL: {exc}") from None
    report(args, latency, fleet)


def bench(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, float]]:
    with tempfile.TemporaryDirectory(prefix="pdserve-operator-bench-") as tmp, cluster_helper(Path(tmp)) as cluster:
        crd = yaml.safe_dump(custom_resource_definition())
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=crd)
        cluster.wait_crd_established()
        node, pods, cidr = cpu_node_for(args.runs, args.fleet)
        ensure_cpu_node(cluster, name=node, pods=pods, cidr=cidr)
        namespace = cluster.create_namespace("bench-op")
        api = KubeApi(new_api_client(cluster.kubeconfig))
        apps = k8s.AppsV1Api(new_api_client(cluster.kubeconfig))
        operator = OperatorProcess(
            cluster.kubeconfig,
            Path(tmp) / "operator.log",
            namespaces=[namespace],
            identity=f"bench-{uuid.uuid4().hex[:6]}",
            lease_name=f"bench-{namespace}",
            lease_namespace=namespace,
            extra=["--resync-seconds", "10", "--relist-seconds", "3600", "--log-level", args.operator_log_level],
        )
        try:
            operator.start().wait_ready()
            # Warm-up, untimed as a run: a watch the operator opens right after the CRD was created (a fresh
            # cluster) can deliver its first event 2 s late, while the API server's watch cache for the new
            # resource waits for etcd's progress notification. That was the 2.17 s "p99" of the first latency run.
            started = time.perf_counter()
            create(api, small_pds("warmup", namespace))
            wait_workloads_created(apps, namespace, "warmup", args.timeout / 10)
            warmup = time.perf_counter() - started
            latency = latency_runs(api, apps, namespace, args.runs, args.timeout / 10)
            latency["first_pdservice_after_start_s"] = warmup
            fleet = fleet_run(api, operator, namespace, args.fleet, args.timeout)
            fleet["baseline_all_ready_s"] = baseline_fleet(api, namespace, args.fleet, args.timeout)
            fleet["all_available_over_baseline"] = fleet["all_available_s"] / fleet["baseline_all_ready_s"]
        except BaseException:
            print(f"operator log (last lines):\n{operator.log_tail()}", file=sys.stderr)
            raise
        finally:
            operator.stop()
            if args.operator_log:
                shutil.copyfile(operator.log_path, args.operator_log)
            cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
    return latency, fleet


def report(args: argparse.Namespace, latency: dict[str, Any], fleet: dict[str, float]) -> None:
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
    first = latency["first_pdservice_after_start_s"] * 1000
    print(f"  first PDService after the operator started (warm-up, not a run): {first:.0f} ms")
    print(f"{args.fleet} PDServices at once:")
    for key, value in fleet.items():
        print(f"  {key:34s} {value:10.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if fleet["writes_per_noop_reconcile"] != 0:
        raise SystemExit("FAIL: no-op reconciles wrote to the API")
    if ratio99 > args.max_p99_ratio:
        raise SystemExit(f"FAIL: apply -> children p99 is {ratio99:.2f}x the baseline's (floor {args.max_p99_ratio}x)")


if __name__ == "__main__":
    main()
