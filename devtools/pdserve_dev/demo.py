"""`pdserve dev demo`: the whole product on one machine, in one command, installed the way users install it.

It starts a local cluster (real control plane, simulated GPU nodes, the process node), installs pdserve with Helm
exactly as the README tells users (`helm install pdserve charts/pdserve -n pdserve-system`: the CRD, RBAC and the
operator Deployment, whose pods run in-cluster on the process node under the chart's ServiceAccount), applies a
PDService (default: the embedded `examples/local-sim.yaml`), waits for `Available`, then sends a long prompt
(routed prefill -> decode, KV pulled over the engine simulator's side channel) and a short one (straight to
decode) through the router, and prints what happened: the route the router chose, the answer, and the decode
engines' `vllm:prompt_tokens_by_source_total` proving the KV was transferred, not recomputed. Then it turns on the
SLO autoscaler for the prefill pool (the chart's `operator.prometheusUrl` points the operator at the cluster's
Prometheus; a `kubectl patch` sets a tight TTFT target), sends a burst of long prompts that breaches the target,
and prints the autoscaler's `Scaled` Event and `kubectl get pds -o wide`. Everything is stopped at the end unless
`--keep` is given.

The cluster's pod addresses (198.18.0.0/15, see pod_network) must stay on this machine: when it can (root), the
demo runs in a private network namespace of its own that holds only a loopback interface. With `--keep`, the
`pdserve dev demo` process the user started then publishes the router, Prometheus and the API server on its own
namespace's 127.0.0.1 and prints those addresses and a kubeconfig for them (`demo_access`, `publish`), so curl,
kubectl and OpenAI clients work from the user's shell; Ctrl-C stops the demo and its relays.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from pdserve_dev.cluster import netns
from pdserve_dev.cluster.cluster import SYSTEM_NAMESPACE, LocalCluster
from pdserve_dev.demo_access import (
    Kept,
    address_of,
    banner,
    control_fd,
    kubectl_path,
    publish_inside,
    run_isolated,
    stop_on_signals,
    write_access,
)
from pdserve_dev.publish import Target
from pdserve_dev.testing.cluster import ClusterHelper
from pdserve_dev.testing.metrics import by_label, scrape_sync
from pdserve_dev.testing.wait import wait_for

DEMO_NAMESPACE = "demo"
RELEASE = "pdserve"
#: Turns on the SLO autoscaler for the demo's prefill pool with a TTFT target its burst breaches; short warm-up
#: and a long scale-down window, so the demo shows one decision and then holds.
AUTOSCALING_PATCH = {
    "spec": {
        "prefill": {"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 2}},
        "slo": {"ttftMilliseconds": 500, "itlMilliseconds": 50, "percentile": 90},
        "autoscaling": {"warmupSeconds": 5, "scaleDownStabilizationSeconds": 120},
    }
}
#: The operator's autoscaler timing for the demo: a decision every 2 s over a 6 s window (defaults: 15 s, 15 s).
AUTOSCALER_FLAGS = ("--autoscaler-interval-seconds=2", "--autoscaler-window-seconds=6")
CHART_ENV = "PDSERVE_CHART"


class DemoError(Exception):
    """The demo cannot run (the message says why and what to do)."""


def chart_path() -> Path:
    """The chart to install: $PDSERVE_CHART, else `charts/pdserve` of the checkout pdserve-dev is installed from."""
    path = Path(os.environ.get(CHART_ENV) or Path(__file__).resolve().parents[2] / "charts" / "pdserve")
    if not (path / "Chart.yaml").is_file():
        raise DemoError(f"No Helm chart at {path}: run the demo from a pdserve checkout or set ${CHART_ENV}")
    return path


def default_manifest() -> str:
    """The embedded demo PDService: examples/local-sim.yaml, linked into the package so wheels carry it."""
    return resources.files("pdserve_dev").joinpath("demo-pdservice.yaml").read_text()


def _post(url: str, body: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any], float]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=60) as response:
        payload = json.loads(response.read())
        return dict(response.headers), payload, time.perf_counter() - started


def prompt_tokens_by_source(helper: ClusterHelper, namespace: str) -> dict[str, float]:
    """Decode engines' `vllm:prompt_tokens_by_source_total`, summed over the pool, by source (shared with the
    end-to-end test)."""
    totals: dict[str, float] = {}
    for ip in helper.pod_ips(namespace, "pdserve.io/role=decode"):
        text = scrape_sync(f"http://{ip}:8000/metrics")
        for source, value in by_label(text, "vllm:prompt_tokens_by_source_total", "source").items():
            totals[source] = totals.get(source, 0.0) + value
    return totals


def install_chart(
    cluster: LocalCluster, chart: Path, echo: Callable[[str], None], prometheus_url: str | None = None
) -> float:
    """`helm install pdserve <chart> -n pdserve-system --wait` (with `operator.prometheusUrl` and the demo's fast
    autoscaler timing when a Prometheus is given); returns the seconds it took."""
    started = time.monotonic()
    values: list[str] = []
    if prometheus_url:
        values = [
            f"--set=operator.prometheusUrl={prometheus_url}",
            f"--set-json=operator.extraArgs={json.dumps(list(AUTOSCALER_FLAGS))}",
        ]
    argv = cluster.helm_command("install", RELEASE, str(chart), f"--namespace={SYSTEM_NAMESPACE}", "--wait", *values)
    proc = subprocess.run([*argv, "--timeout=3m"], capture_output=True, text=True, timeout=240, check=False)
    if proc.returncode != 0:
        raise DemoError(f"helm install failed:\n{proc.stderr.strip() or proc.stdout.strip()}")
    seconds = time.monotonic() - started
    shown = f" --set operator.prometheusUrl={prometheus_url}" if prometheus_url else ""
    echo(f"Installed pdserve with Helm in {seconds:.1f}s: helm install {RELEASE} {chart} -n {SYSTEM_NAMESPACE}{shown}")
    return seconds


def scaled_events(helper: ClusterHelper, namespace: str, name: str) -> list[str]:
    """The autoscaler's `Scaled` Events about PDService `name`, oldest first."""
    items = helper.get_json(
        "events", f"--namespace={namespace}", f"--field-selector=involvedObject.name={name},reason=Scaled"
    )["items"]
    return [e["message"] for e in sorted(items, key=lambda e: e.get("lastTimestamp") or "")]


async def _burst(helper: ClusterHelper, base: str, model: str, name: str, within: float) -> list[str]:
    """Long prompts faster than one prefill engine computes them, until the autoscaler scales (or `within` s)."""
    from pdserve_dev.testing.load import Load

    async with Load(base, model, seed=5) as load:
        load.arrivals(20.0, 1500, 4)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while loop.time() < deadline:
            events = await asyncio.to_thread(scaled_events, helper, DEMO_NAMESPACE, name)
            if events:
                return events
            await asyncio.sleep(1.0)
    return []


def show_autoscaling(helper: ClusterHelper, name: str, base: str, model: str, echo: Callable[[str], None]) -> bool:
    """Turn on the prefill pool's SLO autoscaling, breach its TTFT target with a burst, print the decision."""
    patch = json.dumps(AUTOSCALING_PATCH, separators=(",", ":"))
    echo(f"Turning on SLO autoscaling: kubectl patch pds {name} -n {DEMO_NAMESPACE} --type merge -p '{patch}'")
    helper.kubectl("patch", "pds", name, f"--namespace={DEMO_NAMESPACE}", "--type=merge", f"--patch={patch}")
    echo("Sending long prompts faster than one prefill engine computes them (TTFT target 500 ms)...")
    started = time.monotonic()
    events = asyncio.run(_burst(helper, base, model, name, within=90.0))
    if not events:
        echo("No scaling decision within 90 s; the PDService's status says why:")
        echo(helper.kubectl("get", "pds", name, f"--namespace={DEMO_NAMESPACE}", "-o", "yaml").stdout)
        return False
    echo(f"Event after {time.monotonic() - started:.0f}s: {events[0]}")
    echo(helper.kubectl("get", "pds", name, f"--namespace={DEMO_NAMESPACE}", "-o", "wide").stdout)
    return True


def run_demo(manifest: str, keep: bool, echo: Callable[[str], None], control: int | None = None) -> int:
    """Run the demo; returns a process exit code. `control`: the pipe to the process outside (`demo_access`)."""
    doc = yaml.safe_load(manifest)
    doc.setdefault("metadata", {})["namespace"] = DEMO_NAMESPACE
    name = doc["metadata"]["name"]
    model = doc["spec"]["model"]["name"]
    chart = chart_path()
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-demo-"))
    cluster = LocalCluster(workdir / "cluster", topology="minimal", process_node=True, log=_cluster_log(echo, control))
    try:
        cluster.start()
        helper = ClusterHelper.from_cluster(cluster)
        prometheus = cluster.start_prometheus()
        install_chart(cluster, chart, echo, prometheus)
        echo(helper.kubectl("get", "pods", f"--namespace={SYSTEM_NAMESPACE}", "-o", "wide").stdout)
        helper.kubectl("create", "namespace", DEMO_NAMESPACE)
        echo(f"Applying PDService {DEMO_NAMESPACE}/{name}")
        helper.apply(json.dumps(doc))
        started = time.monotonic()
        helper.kubectl(
            "wait", "--for=condition=Available", f"pds/{name}", "-n", DEMO_NAMESPACE, "--timeout=180s", timeout=200
        )
        echo(f"PDService Available after {time.monotonic() - started:.1f}s")
        echo(helper.kubectl("get", "pds,statefulsets,deployments,pods", "-n", DEMO_NAMESPACE, "-o", "wide").stdout)
        router_ip = wait_for(lambda: helper.pod_ips(DEMO_NAMESPACE, "pdserve.io/role=router"), timeout=60)[0]
        port = router_port(helper, name)
        base = f"http://{router_ip}:{port}"
        before = prompt_tokens_by_source(helper, DEMO_NAMESPACE)
        long_prompt = " ".join(f"token{i}" for i in range(600))
        headers, body, seconds = _post(
            f"{base}/v1/completions", {"model": model, "prompt": long_prompt, "max_tokens": 16}
        )
        echo(
            f"Long prompt ({body['usage']['prompt_tokens']} tokens): route={headers.get('X-Pdserve-Route')} "
            f"in {seconds * 1000:.0f} ms -> {body['choices'][0]['text']!r}"
        )
        after = prompt_tokens_by_source(helper, DEMO_NAMESPACE)
        moved = after.get("external_kv_transfer", 0.0) - before.get("external_kv_transfer", 0.0)
        computed = after.get("local_compute", 0.0) - before.get("local_compute", 0.0)
        echo(
            f"Decode engines: {moved:.0f} prompt tokens pulled from prefill over the (simulated) NIXL side channel, "
            f"{computed:.0f} computed locally"
        )
        headers, body, seconds = _post(
            f"{base}/v1/chat/completions",
            {"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8},
        )
        echo(
            f"Short chat: route={headers.get('X-Pdserve-Route')} in {seconds * 1000:.0f} ms -> "
            f"{body['choices'][0]['message']['content']!r}"
        )
        scaled = show_autoscaling(helper, name, base, model, echo)
        if keep:
            kept = Kept(
                workdir=str(workdir),
                kubeconfig=str(cluster.kubeconfig),
                sockets={},
                namespace=DEMO_NAMESPACE,
                name=name,
                model=model,
                operator_logs=f"{cluster.process_node_workdir / 'logs'}/{SYSTEM_NAMESPACE}_*_operator.log",
            )
            keep_running(
                kept,
                cluster=cluster,
                helper=helper,
                router=(router_ip, port),
                prometheus=prometheus,
                control=control,
                echo=echo,
            )
            return 130  # stopped by a signal
        return 0 if moved > 0 and scaled else 1
    except KeyboardInterrupt:
        return 130
    finally:
        cluster.stop()
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)


def _cluster_log(echo: Callable[[str], None], control: int | None) -> Callable[[str], None]:
    """The cluster's progress lines; in a namespace of its own, an address they name is said to be there (the user
    gets the published ones at the end)."""
    if control is None:
        return echo
    return lambda line: echo(f"{line} (inside the demo's network namespace)" if "://" in line else line)


def router_port(helper: ClusterHelper, name: str) -> int:
    """The router's port, from the PDService's `status.routerEndpoint` (http://<service>.<namespace>.svc:<port>)."""
    endpoint = helper.get_json("pds", name, f"--namespace={DEMO_NAMESPACE}")["status"]["routerEndpoint"]
    return address_of(endpoint)[1]


def keep_running(
    kept: Kept,
    *,
    cluster: LocalCluster,
    helper: ClusterHelper,
    router: tuple[str, int],
    prometheus: str,
    control: int | None,
    echo: Callable[[str], None],
) -> None:
    """Serve until Ctrl-C (or SIGTERM): publish the router, Prometheus and the API server to the process outside
    (when the demo runs in a namespace of its own), or print their addresses (when it runs where the user is)."""
    assert cluster.state is not None  # started
    server = cluster.state.server
    if control is None:
        router_url = f"http://{router[0]}:{router[1]}"
        access = write_access(kept, router_url, prometheus, server, cluster.kubeconfig)
        echo(banner(kept, access, kubectl_path(), local=True))
        while True:
            time.sleep(3600)

    def router_addresses() -> list[tuple[str, int]]:
        return [(ip, router[1]) for ip in helper.serving_ips(DEMO_NAMESPACE, "pdserve.io/role=router")]

    targets = {
        "router": Target("router", router, router_addresses),
        "prometheus": Target("prometheus", address_of(prometheus)),
        "apiserver": Target("apiserver", address_of(server)),
    }
    asyncio.run(publish_inside(kept, targets, control))


def main(manifest_path: str | None, keep: bool, echo: Callable[[str], None] = print) -> int:
    """Entry point of `pdserve dev demo`: run in a private network namespace of its own when possible (publishing
    what `--keep` keeps running on this namespace's loopback, `demo_access`), else here."""
    control = control_fd()
    if control is None and netns.can_isolate():
        args = ["-f", str(Path(manifest_path).resolve())] if manifest_path else []
        argv = [sys.executable, "-m", "pdserve.cli", "dev", "demo", *args, *(["--keep"] if keep else [])]
        return run_isolated(argv, echo)
    if control is not None:
        stop_on_signals()
    manifest = Path(manifest_path).read_text() if manifest_path else default_manifest()
    try:
        return run_demo(manifest, keep, echo, control)
    except DemoError as exc:
        echo(f"Error: {exc}")
        return 1
