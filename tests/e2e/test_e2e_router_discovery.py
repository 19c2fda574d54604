"""End to end on the local cluster: the router finds and pairs engines with nothing but its own Role, which holds
EndpointSlices and its one discovery ConfigMap and no Pods; a namespace user holding `edit` cannot get a prompt
routed to a pod of theirs (their own Service with the pool's labels, their pod carrying them, a hand-made
EndpointSlice); and a rolling update of the engine image (a new kv-compat value) never pairs a prefill engine with
a decode engine of another value.

Real: the API server and its RBAC, the operator (a process), the StatefulSet and EndpointSlice controllers, the
engines (the process node runs the vLLM image as the simulator, with the renderer's command line and its
`PDSERVE_KV_COMPAT`, so a mismatched pair is refused at the KV pull and counted by both engines in
`pdserve:sim_kv_compat_mismatch_total`). The router under test is a local process authenticated as the
PDService's router ServiceAccount (a TokenRequest token, what its pod mounts) with the config the operator
rendered: whatever it can discover, it discovers with exactly the Role's permissions.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve_dev.chaos.watch import MismatchWatcher
from pdserve_dev.demo import prompt_tokens_by_source
from pdserve_dev.testing.cluster import ClusterHelper
from pdserve_dev.testing.metrics import metric_value, scrape_sync, series
from pdserve_dev.testing.net import free_port
from pdserve_dev.testing.operator import OperatorProcess
from pdserve_dev.testing.wait import wait_for

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(900)]

NAME = "disc"
ROUTER = f"{NAME}-router"
TOPOLOGY = f"{NAME}-router-discovery"
CONTROL = f"{NAME}-router-control"
# A label of the process node that EndpointSlices do not carry: the operator must read the node and publish it.
TOPOLOGY_KEY = "pdserve.io/process-node"
NEW_IMAGE = "vllm/vllm-openai:v0.32.1"
ENGINES = "pdserve.io/role in (prefill,decode)"


@dataclass
class Service:
    namespace: str
    operator: OperatorProcess
    router: str  # base URL of the router running as the router ServiceAccount
    metrics: str  # base URL of its metrics port
    router_log: Path


def _ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _usable(metrics: str, role: str) -> int:
    try:
        text = scrape_sync(f"{metrics}/metrics", timeout=3)
    except OSError:
        return -1
    return int(metric_value(text, "pdserve_router_endpoint_up", role=role))


def _post(url: str, body: dict[str, Any], timeout: float = 30) -> tuple[int, dict[str, str], dict[str, Any]]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), {"error": error.read().decode(errors="replace")[:300]}


@pytest.fixture(scope="module")
def service(cluster: ClusterHelper, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    if cluster.process_node_workdir is None:
        pytest.skip("the local cluster runs without its process node")
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds" / "pdservice.yaml"))
    cluster.kubectl("wait", "--for=condition=Established", "crd/pdservices.pdserve.io", "--timeout=60s")
    namespace = cluster.create_namespace("disc")
    work = tmp_path_factory.mktemp("discovery")
    router_proc: subprocess.Popen[bytes] | None = None
    try:
        with OperatorProcess(
            cluster.kubeconfig,
            work / "operator.log",
            namespaces=[namespace],
            identity="disc",
            lease_namespace=namespace,
        ) as operator:
            operator.wait_ready()
            doc = yaml.safe_load((ROOT / "examples" / "local-sim.yaml").read_text())
            doc["metadata"] = {"name": NAME, "namespace": namespace}
            doc["spec"]["placement"]["topologyKey"] = TOPOLOGY_KEY
            # Each pool rolls one pod at a time and deletes an old pod as soon as its successor is ready, so within
            # a pool two values are ready together only for a moment. Across pools it lasts: the one prefill
            # engine is new after the first step, while decode still has old engines ready for two more steps.
            doc["spec"]["decode"]["replicas"] = 3
            cluster.apply(json.dumps(doc))

            def settled() -> bool:
                status = cluster.get_json(f"pds/{NAME}", "-n", namespace).get("status", {})
                pools = [status.get("prefill", {}), status.get("decode", {})]
                available = any(
                    c["type"] == "Available" and c["status"] == "True" for c in status.get("conditions", [])
                )
                return available and all(p.get("readyReplicas") == p.get("desiredReplicas") for p in pools)

            wait_for(settled, timeout=240, message=lambda: f"{NAME} Available with full pools\n{operator.log_tail()}")

            # The router as its pod would run it: its ServiceAccount's token, the rendered config.
            kubeconfig = cluster.service_account_kubeconfig(namespace, ROUTER, work / "router.kubeconfig")
            rendered = cluster.get_json("configmap", ROUTER, "-n", namespace)["data"]["router.yaml"]
            (work / "router.yaml").write_text(rendered)
            port, metrics_port = free_port("127.0.0.1"), free_port("127.0.0.1")
            env = {"PATH": "/usr/bin:/bin", "KUBECONFIG": str(kubeconfig), "PDSERVE_BIND_HOST": "127.0.0.1"}
            log_path = work / "router.log"
            with log_path.open("wb") as log:
                router_proc = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "pdserve.cli",
                        "router",
                        "--config",
                        str(work / "router.yaml"),
                        "--port",
                        str(port),
                        "--metrics-port",
                        str(metrics_port),
                    ],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            router, metrics = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}"
            wait_for(
                lambda: _usable(metrics, "prefill") == 1 and _usable(metrics, "decode") == 3,
                timeout=60,
                message=lambda: f"the router sees 1 + 3 engines; its log:\n{log_path.read_text()[-3000:]}",
            )
            yield Service(namespace, operator, router, metrics, log_path)
    finally:
        if router_proc is not None:
            with contextlib.suppress(ProcessLookupError):
                router_proc.send_signal(signal.SIGTERM)
            try:
                router_proc.wait(15)
            except subprocess.TimeoutExpired:
                router_proc.kill()
                router_proc.wait()
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_the_router_service_account_holds_exactly_its_discovery_reads(cluster: ClusterHelper, service: Service) -> None:
    namespace = service.namespace
    user = f"system:serviceaccount:{namespace}:{ROUTER}"
    baseline = cluster.can_i_list(namespace, f"system:serviceaccount:{namespace}:default")
    assert cluster.can_i_list(namespace, user) - baseline == {
        ("endpointslices.discovery.k8s.io", "", "list"),
        ("endpointslices.discovery.k8s.io", "", "watch"),
        ("configmaps", TOPOLOGY, "list"),
        ("configmaps", TOPOLOGY, "watch"),
        ("configmaps", CONTROL, "list"),
        ("configmaps", CONTROL, "watch"),
    }
    for verb, resource in [
        ("get", "pods"),
        ("list", "pods"),
        ("watch", "pods"),
        ("get", "secrets"),
        ("list", "configmaps"),
        ("get", f"configmaps/{ROUTER}"),
        ("get", "nodes"),
        ("get", "endpointslices.discovery.k8s.io"),
        ("create", "endpointslices.discovery.k8s.io"),
    ]:
        assert not cluster.can_i(namespace, user, verb, resource), f"{ROUTER} may {verb} {resource}"
    assert cluster.can_i(namespace, user, "watch", f"configmaps/{TOPOLOGY}")


def test_the_router_reads_the_published_node_topology(cluster: ClusterHelper, service: Service) -> None:
    """The operator read the process node and published its topology label; the router, as its ServiceAccount,
    read that ConfigMap (a list and a watch selecting its name, which the Role's resourceNames allow)."""
    config_map = cluster.get_json("configmap", TOPOLOGY, "-n", service.namespace)
    [node] = {pod["spec"]["nodeName"] for pod in cluster.pods(service.namespace, ENGINES)}
    assert json.loads(config_map["data"]["nodes.json"]) == {"nodes": {node: {TOPOLOGY_KEY: "true"}}}
    wait_for(
        lambda: "Updated node topology nodes=1" in service.router_log.read_text(),
        timeout=30,
        message=lambda: f"the router read the node topology; its log:\n{service.router_log.read_text()[-3000:]}",
    )
    assert "Failed watching" not in service.router_log.read_text()


def test_the_router_applies_the_threshold_the_operator_publishes_and_counts_the_router_replicas(
    cluster: ClusterHelper, service: Service
) -> None:
    """As its ServiceAccount, the router reads the router control ConfigMap (issue 19: the operator publishes the
    PD threshold there while the spec gives it bounds) and its Service's EndpointSlices (the ready router pods,
    the N that divides every engine's budget: the one router pod the operator runs). A ConfigMap of that name
    that a namespace user made is ignored: only the PDService's own (its controller reference) counts."""

    def shown(name: str) -> float:
        return metric_value(scrape_sync(service.metrics + "/metrics"), name)

    def log() -> str:
        return f"router log:\n{service.router_log.read_text()[-3000:]}"

    forged = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": CONTROL},
        "data": {"control.json": json.dumps({"disaggregationThreshold": 1, "reason": "a tenant's"})},
    }
    cluster.apply(forged, namespace=service.namespace)
    wait_for(lambda: "Ignored router control" in service.router_log.read_text(), timeout=30, message=log)
    assert shown("pdserve_router_disaggregation_threshold") == 64
    cluster.kubectl("delete", "configmap", CONTROL, f"--namespace={service.namespace}")

    # Bounds that exclude the configured 64: with no Prometheus the operator decides nothing and publishes the
    # configured value kept within them, 777.
    bounds = {"spec": {"autoscaling": {"disaggregationThreshold": {"minTokens": 777, "maxTokens": 4096}}}}
    patch = ("patch", f"pds/{NAME}", f"--namespace={service.namespace}", "--type=merge")
    cluster.kubectl(*patch, f"--patch={json.dumps(bounds)}")
    wait_for(lambda: shown("pdserve_router_disaggregation_threshold") == 777, timeout=30, message=log)
    ready_routers = [pod for pod in cluster.pods(service.namespace, "pdserve.io/role=router") if _ready(pod)]
    assert ready_routers
    wait_for(lambda: shown("pdserve_router_replicas") == len(ready_routers), timeout=30, message=log)
    # The bounds removed: the operator prunes its ConfigMap, the router is back on its configured value.
    cluster.kubectl(*patch, f"--patch={json.dumps({'spec': {'autoscaling': None}})}")
    wait_for(lambda: shown("pdserve_router_disaggregation_threshold") == 64, timeout=30, message="static again")
    assert "Failed watching" not in service.router_log.read_text()


def test_a_pd_request_pairs_through_the_service_account_router(cluster: ClusterHelper, service: Service) -> None:
    pulled_before = prompt_tokens_by_source(cluster, service.namespace).get("external_kv_transfer", 0.0)
    prompt = " ".join(f"word{i}" for i in range(400))
    status, headers, body = _post(
        f"{service.router}/v1/completions", {"model": "tiny-llama", "prompt": prompt, "max_tokens": 4}
    )
    assert status == 200, body
    assert headers["X-Pdserve-Route"] == "pd"
    pulled = prompt_tokens_by_source(cluster, service.namespace).get("external_kv_transfer", 0.0)
    assert pulled - pulled_before == body["usage"]["prompt_tokens"]


def test_a_tenants_rogue_engine_gets_no_prompt(cluster: ClusterHelper, service: Service, tmp_path: Path) -> None:
    """Issue 18 item 1, as the tenant did it: a namespace user holding `edit` runs an engine of their own (the decode
    pool's pod template, copied: `edit` reads StatefulSets) carrying the decode pool's labels, and a headless
    Service of their own with the labels the router's selector looks for. The cluster admin adds a hand-made
    EndpointSlice with them too (`edit` may not). Before: 4 of 12 prompts reached the tenant's pod (6 of 12 with the
    hand-made slice). Now the router says it ignores all three, and 0 of 12 reach it."""
    namespace = service.namespace
    tenant = cluster.edit_user(namespace, "tenant", tmp_path / "tenant.kubeconfig")
    value = cluster.get_json(f"pds/{NAME}", "-n", namespace)["status"]["kvCompatHash"]
    template = cluster.get_json("statefulset", f"{NAME}-decode", "-n", namespace)["spec"]["template"]
    pool = {"app.kubernetes.io/instance": NAME, "pdserve.io/role": "decode", "pdserve.io/kv-compat": value}
    labels = {**template["metadata"]["labels"], **pool, "tenant": "rogue"}
    rogue = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "rogue", "labels": labels},
        "spec": template["spec"],
    }
    headless = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "rogue", "labels": pool},
        "spec": {"clusterIP": "None", "selector": {"tenant": "rogue"}, "ports": [{"name": "http", "port": 8000}]},
    }
    tenant.apply([rogue, headless], namespace=namespace)
    try:

        def ready_rogue() -> dict[str, Any] | None:
            found: dict[str, Any] = cluster.get_json("pod", "rogue", "-n", namespace)
            return found if _ready(found) else None

        pod = wait_for(ready_rogue, timeout=120, message="the tenant's engine ready")
        ip, port = pod["status"]["podIP"], template["spec"]["containers"][0]["ports"][0]["containerPort"]
        handmade = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"name": "rogue-handmade", "labels": {**pool, "kubernetes.io/service-name": "rogue-handmade"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
            "endpoints": [
                {"addresses": [ip], "conditions": {"ready": True}, "targetRef": {"kind": "Pod", "name": "rogue"}}
            ],
        }
        refused = tenant.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(handmade), check=False)
        assert refused.returncode != 0 and "forbidden" in refused.stderr.lower()
        cluster.apply(handmade, namespace=namespace)

        def rogue_usable() -> bool:
            up = series(scrape_sync(f"{service.metrics}/metrics"), "pdserve_router_endpoint_up", role="decode")
            return any(labels.get("endpoint") == "rogue" and value == 1 for labels, value in up)

        reasons = (
            "slice rogue-",  # the tenant's own Service's slice
            "slice rogue-handmade: not made by the EndpointSlice controller",
            f"endpoint rogue of slice {NAME}-decode-{value}-",  # the operator's own Service selects the rogue pod
        )

        def decided() -> bool:
            log = service.router_log.read_text()
            ignored = all(f"Ignored untrusted decode engines {reason}" in log for reason in reasons)
            return ignored or rogue_usable()

        wait_for(
            decided, timeout=60, message=lambda: f"the router's verdict; log:\n{service.router_log.read_text()[-3000:]}"
        )
        assert not rogue_usable()
        prompt = " ".join(f"rogue{i}" for i in range(400))
        for n in range(12):
            body = {"model": "tiny-llama", "prompt": f"{n} {prompt}", "max_tokens": 4}
            status, _, answer = _post(f"{service.router}/v1/completions", body)
            assert status == 200, answer
        served = metric_value(scrape_sync(f"http://{ip}:{port}/metrics"), "vllm:request_success_total")
        assert served == 0, f"{served:.0f} of 12 prompts reached the tenant's pod"
    finally:
        cluster.kubectl("delete", "endpointslice", "rogue-handmade", "-n", namespace, "--ignore-not-found")
        tenant.kubectl("delete", "pod,service", "rogue", "-n", namespace, "--ignore-not-found", "--wait=false")


@dataclass
class Load:
    """Clients sending long (PD) and short prompts, streaming and not, until stopped; outcomes counted, and
    counted apart while the watcher saw engines of both values ready."""

    router: str
    watcher: MismatchWatcher
    outcomes: Counter[str] = field(default_factory=Counter)
    while_mixed: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    _ids: Iterator[int] = field(default_factory=itertools.count)

    def run(self) -> None:
        while not self.stop.is_set():
            n = next(self._ids)
            words = 300 if n % 4 else 8  # mostly uncached long prompts: the PD path
            prompt = f"Request {n}. " + " ".join(f"w{n}x{i}" for i in range(words))
            body: dict[str, Any] = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 4, "stream": n % 3 == 0}
            mixed = self.watcher.mixed.is_set()
            outcome = self.send(body)
            self.outcomes[outcome] += 1
            if mixed:
                self.while_mixed[outcome] += 1

    def send(self, body: dict[str, Any]) -> str:
        request = urllib.request.Request(
            f"{self.router}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                text = response.read().decode()
                route = str(response.headers["X-Pdserve-Route"])
        except urllib.error.HTTPError as exc:
            self.failures.append(f"{exc.code}: {exc.read().decode(errors='replace')[:200]}")
            return f"http-{exc.code}"
        except OSError as exc:
            self.failures.append(str(exc))
            return "error"
        if body["stream"] and ('"error"' in text or not text.rstrip().endswith("data: [DONE]")):
            self.failures.append(f"stream ended badly: {text[-200:]}")
            return "stream-error"
        return route


def test_a_rolling_update_of_the_engine_image_never_pairs_mismatched_engines(
    cluster: ClusterHelper, service: Service
) -> None:
    namespace = service.namespace
    old = cluster.get_json(f"pds/{NAME}", "-n", namespace)["status"]["kvCompatHash"]
    watcher = MismatchWatcher(cluster, namespace, interval=0.3).start()
    load = Load(service.router, watcher)
    threads = [threading.Thread(target=load.run, daemon=True) for _ in range(3)]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: load.outcomes["pd"] >= 5, timeout=60, message=lambda: f"PD traffic first: {load.outcomes}")
        patch = {"spec": {"engine": {"image": NEW_IMAGE}}}
        cluster.kubectl("patch", f"pds/{NAME}", "-n", namespace, "--type=merge", "-p", json.dumps(patch))
        new = wait_for(
            lambda: (v := cluster.get_json(f"pds/{NAME}", "-n", namespace)["status"]["kvCompatHash"]) != old and v,
            timeout=60,
            message="the operator renders the new kv-compat value",
        )

        def rolled_over() -> bool:
            pods = cluster.pods(namespace, ENGINES)
            values = {p["metadata"]["labels"]["pdserve.io/kv-compat"] for p in pods}
            services = cluster.get_json("services", "-n", namespace, "-l", f"pdserve.io/kv-compat={old}")["items"]
            return len(pods) == 4 and values == {new} and all(map(_ready, pods)) and not services

        wait_for(rolled_over, timeout=400, interval=1, message=lambda: f"the rollout, load so far: {load.outcomes}")
        # The router follows: exactly the four new engines, and PD requests pair them.
        wait_for(lambda: _usable(service.metrics, "prefill") == 1 and _usable(service.metrics, "decode") == 3, 60)
        served = load.outcomes["pd"]
        wait_for(lambda: load.outcomes["pd"] >= served + 10, timeout=60, message="PD traffic after the rollout")
    finally:
        load.stop.set()
        for thread in threads:
            thread.join(timeout=90)
        watcher.stop()  # with a last poll: the last word of every engine still running

    print(
        f"rollout: outcomes {dict(load.outcomes)}, while mixed {dict(load.while_mixed)}, "
        f"polls {watcher.polls} (mixed {watcher.mixed_polls}), mismatches {sum(watcher.mismatches.values())}"
    )
    # The rollout did put engines of both values side by side, with traffic flowing meanwhile: a router that paired
    # by anything but the slices' kv-compat labels would have mixed them.
    assert watcher.mixed_polls > 0 and load.while_mixed["pd"] >= 10, (watcher.mixed_polls, load.while_mixed)
    assert watcher.total == 0, watcher.mismatches
    assert len(watcher.mismatches) >= 8  # the four old engines and the four new ones were all read
    served = load.outcomes["pd"] + load.outcomes["decode-only"] + load.outcomes["fallback"]
    assert served == sum(load.outcomes.values()), (load.outcomes, load.failures[:5])
    routes = series(scrape_sync(f"{service.metrics}/metrics"), "pdserve_router_endpoint_up")
    assert sorted(labels["role"] for labels, _ in routes) == ["decode", "decode", "decode", "prefill"]
