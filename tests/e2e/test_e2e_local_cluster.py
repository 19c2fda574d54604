"""End to end on the local cluster: a user applies a PDService and talks to its router.

Everything is real except the container runtime and the GPUs: kube-apiserver, scheduler and controllers, the
operator as a process, the StatefulSets' pods run by the process node as local processes (the vLLM image runs the
engine simulator with the exact command line the renderer wrote), the EndpointSlice controller publishing their
addresses, and the router discovering them through EndpointSlices and moving KV over the simulator's side channel.
"""

from __future__ import annotations

import itertools
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve_dev.demo import prompt_tokens_by_source
from pdserve_dev.testing.cluster import ClusterHelper
from pdserve_dev.testing.metrics import by_label, metric_value, scrape_sync, series
from pdserve_dev.testing.operator import OperatorProcess
from pdserve_dev.testing.wait import wait_for
from pdserve_operator.render.router import METRICS_PORT

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture(scope="module")
def namespace(cluster: ClusterHelper) -> Iterator[str]:
    if cluster.process_node_workdir is None:
        pytest.skip("the local cluster runs without its process node")
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds" / "pdservice.yaml"))
    cluster.wait_crd_established()
    name = cluster.create_namespace("e2e")
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def demo(cluster: ClusterHelper, namespace: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """examples/local-sim.yaml applied and Available, with the operator running; yields the router's base URL."""
    log = tmp_path_factory.mktemp("e2e") / "operator.log"
    with OperatorProcess(
        cluster.kubeconfig, log, namespaces=[namespace], identity="e2e", lease_namespace=namespace
    ) as op:
        op.wait_ready()
        doc = yaml.safe_load((ROOT / "examples" / "local-sim.yaml").read_text())
        doc["metadata"]["namespace"] = namespace
        cluster.apply(json.dumps(doc))
        result = cluster.kubectl(
            "wait", "--for=condition=Available", "pds/demo", "-n", namespace, "--timeout=180s", check=False, timeout=200
        )
        if result.returncode != 0:
            status = cluster.kubectl("get", "pds/demo", "-n", namespace, "-o", "yaml", check=False).stdout
            pods = cluster.kubectl("get", "pods", "-n", namespace, "-o", "wide", check=False).stdout
            pytest.fail(f"demo never became Available\n{status}\n{pods}\n{op.log_tail()}")

        # Available means every role serves; wait for the whole pools too, so the tests see both decode engines.
        def settled() -> bool:
            status = cluster.get_json("pds/demo", "-n", namespace).get("status", {})
            pools = [status.get("prefill", {}), status.get("decode", {})]
            return all(p.get("readyReplicas") == p.get("desiredReplicas") for p in pools)

        wait_for(settled, timeout=120)
        [router_ip] = cluster.pod_ips(namespace, "pdserve.io/role=router")
        yield f"http://{router_ip}:8080"


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, str], dict[str, Any]]:
    """POST JSON; an HTTP error status is returned like any other (a test asserts on it, nothing retries it)."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), {"error": error.read().decode(errors="replace")[:500]}


def test_status_reports_pools_router_and_kv_compat(cluster: ClusterHelper, namespace: str, demo: str) -> None:
    status = cluster.get_json("pds/demo", "-n", namespace)["status"]
    assert status["prefill"]["readyReplicas"] == 1
    assert status["decode"]["readyReplicas"] == 2
    assert status["routerEndpoint"] == f"http://demo-router.{namespace}.svc:8080"
    compat = {
        p["metadata"]["labels"]["pdserve.io/kv-compat"]
        for p in cluster.pods(namespace, "pdserve.io/role in (prefill,decode)")
    }
    assert compat == {status["kvCompatHash"]}


def test_long_prompt_goes_through_prefill_and_kv_is_pulled(cluster: ClusterHelper, namespace: str, demo: str) -> None:
    pulled_before = prompt_tokens_by_source(cluster, namespace).get("external_kv_transfer", 0.0)
    prompt = " ".join(f"word{i}" for i in range(400))
    status, headers, body = post(f"{demo}/v1/completions", {"model": "tiny-llama", "prompt": prompt, "max_tokens": 8})
    assert status == 200
    assert headers["X-Pdserve-Route"] == "pd"
    assert body["usage"]["completion_tokens"] == 8
    pulled = prompt_tokens_by_source(cluster, namespace).get("external_kv_transfer", 0.0)
    assert pulled - pulled_before == body["usage"]["prompt_tokens"]


def test_short_prompt_goes_straight_to_decode(demo: str) -> None:
    status, headers, body = post(
        f"{demo}/v1/chat/completions",
        {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    assert status == 200
    assert headers["X-Pdserve-Route"] == "decode-only"
    assert body["choices"][0]["message"]["content"]


def test_router_follows_a_replaced_decode_pod(cluster: ClusterHelper, namespace: str, demo: str) -> None:
    old = cluster.get_json("pod", "demo-decode-0", "-n", namespace)
    old_uid, old_ip = old["metadata"]["uid"], old["status"]["podIP"]
    cluster.kubectl("delete", "pod", "demo-decode-0", "-n", namespace, "--wait=true", "--timeout=60s")

    def replacement() -> dict[str, Any] | None:
        for pod in cluster.pods(namespace, "pdserve.io/role=decode"):
            conditions = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions", [])}
            if pod["metadata"]["name"] == "demo-decode-0" and pod["metadata"]["uid"] != old_uid:
                return pod if conditions.get("Ready") == "True" else None
        return None

    new_ip = wait_for(replacement, timeout=90, message="demo-decode-0 recreated and Ready")["status"]["podIP"]
    # The process node gives a recreated pod a new address, as a real node does: only a router that learned it
    # from the EndpointSlice can reach the new engine.
    assert new_ip != old_ip
    new_engine = f"http://{new_ip}:8000"

    # The counted event: the new engine's own request counter (a fresh process starts at 0, and nothing but
    # the router sends it generation requests). Each try is one PD request through the router, which must
    # succeed whatever the router's table says at that moment (it retries a vanished engine before the first
    # byte); a failed request fails the test at once instead of being retried.
    attempt = itertools.count()

    def served_by_the_new_engine() -> bool:
        prompt = f"Request {next(attempt)}. " + " ".join(f"other{i}" for i in range(300))  # nothing cached
        body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 2}
        status, headers, answer = post(f"{demo}/v1/completions", body)
        assert status == 200, answer
        assert headers["X-Pdserve-Route"] == "pd", headers
        served = metric_value(scrape_sync(f"{new_engine}/metrics"), "vllm:request_success_total")
        return served >= 1

    wait_for(
        served_by_the_new_engine,
        timeout=60,
        interval=0.5,
        message=f"a request through the router served by the new demo-decode-0 at {new_engine}",
    )
    pulled = by_label(scrape_sync(f"{new_engine}/metrics"), "vllm:prompt_tokens_by_source_total", "source")
    assert pulled.get("external_kv_transfer", 0) > 0  # it decoded with KV pulled from prefill: the PD path
    # The router's table: exactly the two live decode engines, both usable (the old address is gone).
    metrics = f"{demo.rsplit(':', 1)[0]}:{METRICS_PORT}"  # the router pod's metrics port (never the client port)
    up = series(scrape_sync(f"{metrics}/metrics"), "pdserve_router_endpoint_up", role="decode")
    table = sorted((labels["endpoint"], value) for labels, value in up)
    assert table == [("demo-decode-0", 1.0), ("demo-decode-1", 1.0)]


def test_a_change_of_the_slo_reaches_the_router_without_rolling_it(
    cluster: ClusterHelper, namespace: str, demo: str
) -> None:
    """The TTFT target (the router's queue deadlines) travels in the router control ConfigMap, which the router
    watches: changing `spec.slo` must not restart the routers (it did, through the config hash, while the target was
    in their configuration), and each new value shows in the router's own gauge."""
    [before] = cluster.pods(namespace, "pdserve.io/role=router")
    metrics = f"{demo.rsplit(':', 1)[0]}:{METRICS_PORT}"

    def target_is(seconds: float) -> bool:
        return metric_value(scrape_sync(f"{metrics}/metrics"), "pdserve_router_ttft_target_seconds") == seconds

    try:
        for milliseconds in (900, 450):
            patch = {"spec": {"slo": {"ttftMilliseconds": milliseconds}}}
            cluster.kubectl("patch", "pds/demo", "-n", namespace, "--type=merge", "-p", json.dumps(patch))
            wait_for(partial(target_is, milliseconds / 1000), timeout=60, message=f"the router uses {milliseconds} ms")
    finally:
        remove = '[{"op": "remove", "path": "/spec/slo"}]'
        cluster.kubectl("patch", "pds/demo", "-n", namespace, "--type=json", "-p", remove)
    wait_for(partial(target_is, 0.0), timeout=60, message="no target once the SLO is gone")  # the gauge is absent
    [after] = cluster.pods(namespace, "pdserve.io/role=router")
    assert after["metadata"]["uid"] == before["metadata"]["uid"], "the router pod was replaced"
