"""The process node in the real local cluster: pods run as processes behind real EndpointSlices.

Each test uses its own namespace. Pods use the test image ``pdserve-test/http`` (the image map runs it as
``pdserve_dev.process_node.testserver``) and tolerate the process node's taint.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from pdserve_dev.testing.cluster import ClusterHelper
from pdserve_dev.testing.wait import wait_for

pytestmark = pytest.mark.cluster

Obj = dict[str, Any]
PORT = 8080


def _container(args: list[str] | None = None, **extra: Any) -> Obj:
    container: Obj = {
        "name": "web",
        "image": "pdserve-test/http:1",
        "args": args or ["--port", str(PORT)],
        "ports": [{"name": "http", "containerPort": PORT}],
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"}, "periodSeconds": 1, "failureThreshold": 1},
    }
    container.update(extra)
    return container


def _pod_spec(container: Obj, **extra: Any) -> Obj:
    spec: Obj = {
        "nodeSelector": {"pdserve.io/process-node": "true"},
        "tolerations": [{"key": "pdserve.io/process-node", "operator": "Exists", "effect": "NoSchedule"}],
        "terminationGracePeriodSeconds": 5,
        "containers": [container],
    }
    spec.update(extra)
    return spec


def _statefulset(name: str, replicas: int) -> list[Obj]:
    labels = {"app": name}
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name},
            "spec": {"clusterIP": "None", "selector": labels, "ports": [{"name": "http", "port": PORT}]},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": {"name": name},
            "spec": {
                "serviceName": name,
                "replicas": replicas,
                "podManagementPolicy": "Parallel",
                "selector": {"matchLabels": labels},
                "template": {"metadata": {"labels": labels}, "spec": _pod_spec(_container())},
            },
        },
    ]


@pytest.fixture
def node_dir(cluster: ClusterHelper) -> Path:
    if cluster.process_node_workdir is None:
        pytest.skip("the cluster has no process node")
    if cluster.local is not None and not cluster.local.network.local_route:
        pytest.skip("pod IPs are loopback (no local route): EndpointSlices would list nothing")
    return cluster.process_node_workdir


@pytest.fixture
def namespace(cluster: ClusterHelper) -> Iterator[str]:
    name = cluster.create_namespace("pn")
    try:
        yield name
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def _get(ip: str, path: str = "/", method: str = "GET") -> Obj:
    request = urllib.request.Request(f"http://{ip}:{PORT}{path}", method=method)
    with urllib.request.urlopen(request, timeout=3) as response:
        body: Obj = json.loads(response.read())
        return body


def _endpoints(cluster: ClusterHelper, namespace: str, service: str) -> dict[str, bool]:
    """address -> ready, over every EndpointSlice of ``service``."""
    slices = cluster.get_json(
        "endpointslices", f"--namespace={namespace}", f"--selector=kubernetes.io/service-name={service}"
    )
    found: dict[str, bool] = {}
    for item in slices.get("items", []):
        for endpoint in item.get("endpoints") or []:
            for address in endpoint.get("addresses", []):
                found[address] = bool(endpoint.get("conditions", {}).get("ready"))
    return found


def _ready_endpoints(cluster: ClusterHelper, namespace: str, service: str) -> set[str]:
    return {ip for ip, ready in _endpoints(cluster, namespace, service).items() if ready}


def _pid(node_dir: Path, namespace: str, pod: str, container: str = "web") -> int | None:
    try:
        return int((node_dir / "pids" / f"{namespace}_{pod}_{container}.pid").read_text())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _pod(cluster: ClusterHelper, namespace: str, name: str) -> Obj:
    pod: Obj = cluster.get_json("pod", name, f"--namespace={namespace}")
    return pod


def _is_ready(cluster: ClusterHelper, namespace: str, name: str) -> bool:
    conditions = _pod(cluster, namespace, name)["status"].get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def _wait_serving(cluster: ClusterHelper, namespace: str, service: str, count: int) -> dict[str, str]:
    """Wait for ``count`` ready endpoints; return ip -> pod name, checked by asking each IP over HTTP."""

    def exactly() -> set[str] | None:
        found = _ready_endpoints(cluster, namespace, service)
        return found if len(found) == count else None

    ips = wait_for(
        exactly,
        timeout=60,
        message=lambda: f"{count} ready endpoints of {service}, have {_endpoints(cluster, namespace, service)}",
    )
    return {ip: str(_get(ip)["pod"]) for ip in ips}


def test_statefulset_pods_run_as_processes_behind_endpointslices(
    cluster: ClusterHelper, node_dir: Path, namespace: str
) -> None:
    cluster.apply(_statefulset("web", 2), namespace=namespace)
    served = _wait_serving(cluster, namespace, "web", 2)
    assert sorted(served.values()) == ["web-0", "web-1"]
    for ip, name in served.items():
        pod = _pod(cluster, namespace, name)
        assert pod["status"]["podIP"] == ip
        assert pod["spec"]["nodeName"] == "process-node"
        pid = _pid(node_dir, namespace, name)
        assert pid is not None and _alive(pid)
        assert pod["status"]["containerStatuses"][0]["containerID"] == f"process://{pid}"
        assert (node_dir / "logs" / f"{namespace}_{name}_web.log").exists()

    # Scale up: a third process and endpoint.
    cluster.kubectl("scale", "statefulset/web", "--replicas=3", f"--namespace={namespace}")
    served = _wait_serving(cluster, namespace, "web", 3)
    assert sorted(served.values()) == ["web-0", "web-1", "web-2"]

    # Scale down: the processes of web-1 and web-2 end and their PID files go away.
    pids = {name: _pid(node_dir, namespace, name) for name in ("web-1", "web-2")}
    cluster.kubectl("scale", "statefulset/web", "--replicas=1", f"--namespace={namespace}")
    served = _wait_serving(cluster, namespace, "web", 1)
    assert list(served.values()) == ["web-0"]
    assert all(pids.values()), pids
    wait_for(lambda: not any(_alive(p) for p in pids.values() if p), timeout=15, message="processes to exit")
    wait_for(lambda: all(_pid(node_dir, namespace, n) is None for n in pids), timeout=15, message="PID files gone")
    wait_for(lambda: len(cluster.pods(namespace, "app=web")) == 1, timeout=30, message="pod objects deleted")


def test_deleted_pod_comes_back_with_the_same_name_and_a_new_process(
    cluster: ClusterHelper, node_dir: Path, namespace: str
) -> None:
    cluster.apply(_statefulset("echo", 1), namespace=namespace)
    (old_ip,) = _wait_serving(cluster, namespace, "echo", 1)
    old_uid = _pod(cluster, namespace, "echo-0")["metadata"]["uid"]
    old_pid = _pid(node_dir, namespace, "echo-0")
    assert old_pid is not None
    cluster.kubectl("delete", "pod", "echo-0", f"--namespace={namespace}", "--wait=false")
    wait_for(lambda: not _alive(old_pid), timeout=15, message="the old process to exit")
    wait_for(
        lambda: _pod(cluster, namespace, "echo-0")["metadata"]["uid"] != old_uid,
        timeout=30,
        message="a new echo-0",
    )
    served = _wait_serving(cluster, namespace, "echo", 1)
    assert list(served.values()) == ["echo-0"]
    new_pid = _pid(node_dir, namespace, "echo-0")
    assert new_pid is not None and new_pid != old_pid and _alive(new_pid)
    assert old_ip not in served  # a new pod gets a new address, as on a real node


def test_failing_readiness_takes_the_pod_out_of_the_endpoints(
    cluster: ClusterHelper, node_dir: Path, namespace: str
) -> None:
    cluster.apply(_statefulset("ready", 2), namespace=namespace)
    served = _wait_serving(cluster, namespace, "ready", 2)
    ip = next(ip for ip, name in served.items() if name == "ready-0")
    _get(ip, "/ready?ok=false", method="POST")
    wait_for(
        lambda: _endpoints(cluster, namespace, "ready").get(ip) is False,
        timeout=30,
        message=lambda: f"{ip} not ready in the EndpointSlice: {_endpoints(cluster, namespace, 'ready')}",
    )
    pod = _pod(cluster, namespace, "ready-0")
    assert pod["status"]["phase"] == "Running"
    assert pod["status"]["containerStatuses"][0]["ready"] is False
    assert {c["type"]: c["status"] for c in pod["status"]["conditions"]}["Ready"] == "False"
    _get(ip, "/ready?ok=true", method="POST")
    wait_for(lambda: _ready_endpoints(cluster, namespace, "ready") == set(served), timeout=30)

    # A pod deleted outright (no grace, the object is gone at once) still has its process stopped.
    pid = _pid(node_dir, namespace, "ready-1")
    assert pid is not None
    cluster.kubectl("delete", "pod", "ready-1", f"--namespace={namespace}", "--force", "--grace-period=0")
    wait_for(lambda: not _alive(pid), timeout=10, message="the force-deleted pod's process to exit")


def _conditions(cluster: ClusterHelper, namespace: str, service: str, ip: str) -> Obj | None:
    """The EndpointSlice conditions of address ``ip`` of ``service`` (None when it is not listed)."""
    slices = cluster.get_json(
        "endpointslices", f"--namespace={namespace}", f"--selector=kubernetes.io/service-name={service}"
    )
    for item in slices.get("items", []):
        for endpoint in item.get("endpoints") or []:
            if ip in endpoint.get("addresses", []):
                conditions: Obj = endpoint.get("conditions") or {}
                return conditions
    return None


def test_graceful_deletion_runs_the_prestop_hook_and_keeps_probing_readiness(
    cluster: ClusterHelper, node_dir: Path, namespace: str, tmp_path: Path
) -> None:
    """What the kubelet does on deletion: preStop first (the server keeps serving, its endpoint terminating),
    readiness still probed (a server that starts refusing stops `serving`), then SIGTERM."""
    mark = tmp_path / "prestop"
    container = _container(
        env=[
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "HOOK_MARK", "value": str(mark)},
        ],
        lifecycle={"preStop": {"exec": {"command": ["sh", "-c", 'echo "$POD_NAME" > "$HOOK_MARK"; sleep 10']}}},
    )
    objects = _statefulset("drain", 1)
    objects[1]["spec"]["template"]["spec"] = _pod_spec(container, terminationGracePeriodSeconds=30)
    cluster.apply(objects, namespace=namespace)
    (ip,) = _wait_serving(cluster, namespace, "drain", 1)
    pid = _pid(node_dir, namespace, "drain-0")
    assert pid is not None
    cluster.kubectl("scale", "statefulset/drain", "--replicas=0", f"--namespace={namespace}")  # a scale-down

    def terminating() -> Obj | None:
        conditions = _conditions(cluster, namespace, "drain", ip)
        return conditions if conditions and conditions.get("terminating") else None

    conditions = wait_for(terminating, timeout=30, message="the endpoint marked terminating")
    assert conditions["ready"] is False and conditions["serving"] is True
    wait_for(mark.exists, timeout=30, message="the preStop hook to run")
    assert mark.read_text().strip() == "drain-0"  # with the container's environment
    # The hook holds SIGTERM back: the server still answers.
    assert _alive(pid) and _get(ip)["pod"] == "drain-0"
    # Readiness is still probed while the pod terminates.
    _get(ip, "/ready?ok=false", method="POST")
    wait_for(
        lambda: (_conditions(cluster, namespace, "drain", ip) or {}).get("serving") is False,
        timeout=30,
        message=lambda: f"serving false in the EndpointSlice: {_conditions(cluster, namespace, 'drain', ip)}",
    )
    wait_for(lambda: not _alive(pid), timeout=40, message="the process to exit after the hook")
    wait_for(lambda: not cluster.pods(namespace, "app=drain"), timeout=30, message="the pod object deleted")


def test_crashing_container_backs_off_and_counts_restarts(
    cluster: ClusterHelper, node_dir: Path, namespace: str
) -> None:
    crash = _container(args=["--port", str(PORT), "--exit-after", "0.5", "--exit-code", "3"])
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "crash"}, "spec": _pod_spec(crash)}
    cluster.apply(pod, namespace=namespace)
    seen_backoff = wait_for(
        lambda: (
            (s := _pod(cluster, namespace, "crash")["status"].get("containerStatuses", [{}])[0])
            .get("state", {})
            .get("waiting", {})
            .get("reason")
            == "CrashLoopBackOff"
            and s
        ),
        timeout=30,
        message=lambda: f"CrashLoopBackOff, have {_pod(cluster, namespace, 'crash')['status']}",
    )
    assert seen_backoff["lastState"]["terminated"]["exitCode"] == 3
    # Restarted at once after the first exit, then after 10 s of back-off: the count keeps growing.
    status = wait_for(
        lambda: (s := _pod(cluster, namespace, "crash")["status"]["containerStatuses"][0])["restartCount"] >= 2 and s,
        timeout=40,
    )
    assert status["lastState"]["terminated"]["reason"] == "Error"
    assert _pod(cluster, namespace, "crash")["status"]["phase"] == "Running"
    log = (node_dir / "logs" / f"{namespace}_crash_web.log").read_text()
    assert log.count("--- process-node:") >= 3
    events = cluster.get_json("events", f"--namespace={namespace}", "--field-selector=involvedObject.name=crash")
    reasons = {event["reason"] for event in events["items"]}
    assert {"Started", "BackOff"} <= reasons, reasons


def test_failing_liveness_restarts_the_container(cluster: ClusterHelper, node_dir: Path, namespace: str) -> None:
    live = _container(
        startupProbe={"tcpSocket": {"port": PORT}, "periodSeconds": 1, "failureThreshold": 30},
        livenessProbe={"httpGet": {"path": "/healthz", "port": PORT}, "periodSeconds": 1, "failureThreshold": 2},
    )
    cluster.apply(
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "live"}, "spec": _pod_spec(live)}, namespace=namespace
    )
    ip = wait_for(
        lambda: _pod(cluster, namespace, "live")["status"].get("podIP") if _pid(node_dir, namespace, "live") else None,
        timeout=30,
    )
    first_pid: int = wait_for(lambda: _pid(node_dir, namespace, "live") if _get(ip) else None, timeout=30)
    _get(ip, "/health?ok=false", method="POST")
    status = wait_for(
        lambda: (
            (s := _pod(cluster, namespace, "live")["status"]["containerStatuses"][0])["restartCount"] == 1
            and s.get("ready")
            and s
        ),
        timeout=30,
    )
    assert status["lastState"]["terminated"]["message"].startswith("Liveness probe failed")
    assert status["started"] is True  # the startup probe passed again after the restart
    assert not _alive(first_pid)
    assert _get(ip)["pod"] == "live"  # the new process serves on the same pod IP


def test_vllm_image_runs_the_engine_simulator_on_the_pod_ip(
    cluster: ClusterHelper, node_dir: Path, namespace: str
) -> None:
    kv = '{"kv_connector":"NixlConnector","kv_role":"kv_producer","engine_id":"$(POD_NAME)"}'
    engine = {
        "name": "vllm",
        "image": "vllm/vllm-openai:v0.32.0",
        "command": ["vllm", "serve"],
        "args": ["tiny-llama", "--port", "8000", "--kv-transfer-config", kv],
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "PDSERVE_SIM_FAST", "value": "1"},
        ],
        "resources": {"limits": {"nvidia.com/gpu": "1", "rdma/ib": "1"}},
        "readinessProbe": {"httpGet": {"path": "/health", "port": 8000}, "periodSeconds": 1},
    }
    pods = [
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"prefill-{i}"}, "spec": _pod_spec(engine)}
        for i in range(2)
    ]
    cluster.apply(pods, namespace=namespace)
    for i in range(2):
        name = f"prefill-{i}"
        wait_for(
            partial(_is_ready, cluster, namespace, name), timeout=60, message=partial(cluster.logs, namespace, name)
        )
        ip = _pod(cluster, namespace, name)["status"]["podIP"]
        # Both engines use port 8000 (and the side-channel port) on their own pod IPs.
        with urllib.request.urlopen(f"http://{ip}:8000/v1/models", timeout=5) as response:
            models = json.loads(response.read())
        assert [m["id"] for m in models["data"]] == ["tiny-llama"]


def test_init_containers_run_first_and_sidecars_keep_running(
    cluster: ClusterHelper, node_dir: Path, namespace: str
) -> None:
    work = [{"name": "work", "mountPath": "/work"}]
    init = {
        "name": "prepare",
        "image": "busybox",
        "command": ["sh", "-c", 'sleep 0.5; echo init-was-here > "$1"', "prepare", "/work/marker"],
        "volumeMounts": work,
    }
    sidecar = _container(
        args=["--port", "9090"],
        name="side",
        restartPolicy="Always",
        ports=[],
        readinessProbe={"httpGet": {"path": "/readyz", "port": 9090}, "periodSeconds": 1},
    )
    main = {
        "name": "main",
        "image": "busybox",
        "command": ["sh", "-c", 'cat "$1" && exec sleep 300', "main", "/work/marker"],
        "volumeMounts": work,
    }
    spec = _pod_spec(main, initContainers=[init, sidecar], volumes=[{"name": "work", "emptyDir": {}}])
    cluster.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "seq"}, "spec": spec}, namespace=namespace)
    wait_for(
        partial(_is_ready, cluster, namespace, "seq"),
        timeout=30,
        message=lambda: str(_pod(cluster, namespace, "seq")["status"]),
    )
    status = _pod(cluster, namespace, "seq")["status"]
    init_states = {s["name"]: s for s in status["initContainerStatuses"]}
    assert init_states["prepare"]["state"]["terminated"]["exitCode"] == 0
    assert "running" in init_states["side"]["state"] and init_states["side"]["ready"] is True
    assert status["containerStatuses"][0]["restartCount"] == 0  # the marker was there when main started
    assert "init-was-here" in (node_dir / "logs" / f"{namespace}_seq_main.log").read_text()
    ip = status["podIP"]
    with urllib.request.urlopen(f"http://{ip}:9090/", timeout=5) as response:
        assert json.loads(response.read())["pod"] == "seq"


def test_volumes_downward_api_and_completion(cluster: ClusterHelper, node_dir: Path, namespace: str) -> None:
    cluster.apply(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg"}, "data": {"greeting": "hello"}},
        namespace=namespace,
    )
    # The script checks the mounted file (at its mountPath in the container's own mount namespace), the
    # downward-API env and the $(VAR) expansion of args, then exits 0.
    script = 'test "$(cat "$1")" = hello && test "$2" = "$MY_IP" && test -n "$MY_IP" && echo ok'
    job = {
        "name": "check",
        "image": "busybox:1.36",
        "command": ["sh", "-c", script, "check"],
        "args": ["/etc/cfg/greeting", "$(MY_IP)"],
        "env": [{"name": "MY_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "volumeMounts": [{"name": "cfg", "mountPath": "/etc/cfg"}],
    }
    unknown = {"name": "mystery", "image": "quay.io/nobody/mystery:1"}
    # OnFailure: the first run fails, the immediate restart finds its marker in the pod's emptyDir (its working
    # folder; a container's own files do not survive a restart) and succeeds.
    retry = {
        "name": "retry",
        "image": "busybox",
        "command": ["sh", "-c", "test -f done || { touch done; exit 4; }"],
        "workingDir": "/state",
        "volumeMounts": [{"name": "state", "mountPath": "/state"}],
    }
    pods = [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "check"},
            "spec": _pod_spec(job, restartPolicy="Never", volumes=[{"name": "cfg", "configMap": {"name": "cfg"}}]),
        },
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "mystery"}, "spec": _pod_spec(unknown)},
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "retry"},
            "spec": _pod_spec(retry, restartPolicy="OnFailure", volumes=[{"name": "state", "emptyDir": {}}]),
        },
    ]
    cluster.apply(pods, namespace=namespace)
    wait_for(
        lambda: _pod(cluster, namespace, "check")["status"].get("phase") == "Succeeded",
        timeout=30,
        message=lambda: f"check to succeed: {cluster.logs(namespace, 'check')}",
    )
    assert "ok" in (node_dir / "logs" / f"{namespace}_check_check.log").read_text()
    wait_for(lambda: _pod(cluster, namespace, "retry")["status"].get("phase") == "Succeeded", timeout=30)
    retried = _pod(cluster, namespace, "retry")["status"]["containerStatuses"][0]
    assert retried["restartCount"] == 1
    assert retried["lastState"]["terminated"]["exitCode"] == 4
    assert retried["state"]["terminated"]["exitCode"] == 0
    waiting = wait_for(
        lambda: (
            _pod(cluster, namespace, "mystery")["status"]
            .get("containerStatuses", [{}])[0]
            .get("state", {})
            .get("waiting", {})
            .get("reason")
            == "ImageNotMapped"
            and _pod(cluster, namespace, "mystery")["status"]["containerStatuses"][0]["state"]["waiting"]
        ),
        timeout=30,
    )
    assert "quay.io/nobody/mystery:1" in waiting["message"]


# --- a second process node of our own: registration, restart, shutdown ---------------------------------
class _ExtraNode:
    """A process node started by the test itself (so the test may kill and restart it)."""

    def __init__(self, cluster: ClusterHelper, workdir: Path, name: str, pod_cidr: str) -> None:
        self.argv = [
            sys.executable,
            "-m",
            "pdserve_dev.process_node",
            f"--kubeconfig={cluster.kubeconfig}",
            f"--node-name={name}",
            f"--workdir={workdir}",
            f"--pod-cidr={pod_cidr}",
            "--shutdown-grace=5",
        ]
        self.log = workdir / "node.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.process is not None
        self.process.send_signal(sig)
        try:
            return self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def test_process_node_registers_restarts_its_pods_and_stops_them(
    cluster: ClusterHelper, node_dir: Path, namespace: str, tmp_path: Path
) -> None:
    assert cluster.local is not None
    cidr = cluster.local.network.process_node_cidr
    assert cidr is not None
    name = f"pn-extra-{namespace.rsplit('-', 1)[-1]}"
    node = _ExtraNode(cluster, tmp_path / "node", name, cidr)
    pods_dir = tmp_path / "node" / "pids"
    node.start()
    try:
        # `kubectl get` with check=False: "not registered yet" is a reason to poll again, not a verdict (a failed
        # check raises AssertionError, which wait_for rightly never retries).
        registered = wait_for(
            lambda: (
                (proc := cluster.kubectl("get", "node", name, "-o", "json", check=False)).returncode == 0
                and (n := json.loads(proc.stdout))
                and any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"]["conditions"])
                and n
            ),
            timeout=30,
            message=lambda: f"node {name} Ready; log:\n{node.log.read_text()}",
        )
        assert registered["metadata"]["labels"]["pdserve.io/process-node"] == "true"
        assert {"key": "pdserve.io/process-node", "value": "true", "effect": "NoSchedule"} in registered["spec"][
            "taints"
        ]
        assert registered["status"]["capacity"]["nvidia.com/gpu"] == "64"
        lease = cluster.get_json("lease", name, "--namespace=kube-node-lease")
        assert lease["spec"]["holderIdentity"] == name

        spec = _pod_spec(_container(), nodeName=name)
        cluster.apply(
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "solo"}, "spec": spec}, namespace=namespace
        )

        def serving() -> tuple[str, int] | None:
            status = _pod(cluster, namespace, "solo")["status"]
            pid = _pid(pods_dir.parent, namespace, "solo")
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", []))
            return (status["podIP"], pid) if ready and pid and _get(status["podIP"])["pod"] == "solo" else None

        ip, first_pid = wait_for(serving, timeout=30, message=node.log.read_text)

        # Killed outright, the node leaves its pod's process behind; restarted, it kills that process,
        # starts the container again and keeps the pod's IP.
        node.stop(signal.SIGKILL)
        assert _alive(first_pid)
        node.start()
        wait_for(lambda: not _alive(first_pid), timeout=30, message="the leftover process to be killed")

        def restarted() -> tuple[str, int] | None:
            found = serving()
            return found if found and found[1] != first_pid else None

        ip_again, second_pid = wait_for(restarted, timeout=30, message=node.log.read_text)
        assert ip_again == ip

        # SIGTERM: the node stops its pods' processes and exits cleanly; the pod object stays.
        assert node.stop() == 0
        assert not _alive(second_pid)
        assert not list(pods_dir.glob("*.pid"))
        assert _pod(cluster, namespace, "solo")["metadata"].get("deletionTimestamp") is None
    finally:
        if node.process is not None and node.process.poll() is None:
            node.stop()
        cluster.kubectl("delete", "pod", "solo", f"--namespace={namespace}", "--force", "--grace-period=0", check=False)
        cluster.kubectl("delete", "node", name, "--wait=false", check=False)
        for pid_file in pods_dir.glob("*.pid"):  # never leave a process behind, even when the test failed
            with contextlib.suppress(ValueError, ProcessLookupError):
                os.killpg(int(pid_file.read_text()), signal.SIGKILL)


def test_a_status_report_never_lands_on_a_same_named_successor(cluster: ClusterHelper, namespace: str) -> None:
    """The worker of a force-deleted pod may report once more before it notices the deletion, when the
    StatefulSet's replacement (same name, new UID) already exists: its report carries its pod's UID, which the API
    server checks, so the successor's status (its address) stays the successor's own. Without the check the stale
    address merged into the successor's podIPs and every later report of it failed: it never turned Ready."""
    from kubernetes.client.exceptions import ApiException

    from pdserve_dev.process_node.kube import Kube

    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "successor"}}
    pod["spec"] = {"nodeName": "no-such-node", "containers": [{"name": "c", "image": "pdserve-test/http:1"}]}
    cluster.apply(pod, namespace=namespace)
    uid = _pod(cluster, namespace, "successor")["metadata"]["uid"]
    kube = Kube(str(cluster.kubeconfig))
    with pytest.raises(ApiException) as refused:
        kube.patch_pod_status(namespace, "successor", {"podIP": "198.18.9.9"}, uid="0" * 8 + uid[8:])
    # Refused whichever way the API server words it (a UID that does not match the object is invalid for it).
    assert refused.value.status in (409, 422), refused.value.body
    assert "uid" in str(refused.value.body).lower(), refused.value.body
    assert "podIP" not in _pod(cluster, namespace, "successor")["status"]
    kube.patch_pod_status(namespace, "successor", {"podIP": "198.18.9.9", "podIPs": [{"ip": "198.18.9.9"}]}, uid=uid)
    assert _pod(cluster, namespace, "successor")["status"]["podIPs"] == [{"ip": "198.18.9.9"}]


def test_a_pod_marked_not_ready_by_another_writer_is_reported_ready_again(
    cluster: ClusterHelper, node_dir: Path, namespace: str
) -> None:
    """What the node lifecycle controller does after a control-plane outage longer than the node's grace period:
    it marks the node's pods Ready=False in the API. The process node, whose probes still pass, reports them Ready
    again (as the kubelet's status manager reconciles), or they stay out of their Services for good."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "marked"}, "spec": _pod_spec(_container())}
    cluster.apply(pod, namespace=namespace)
    wait_for(partial(_is_ready, cluster, namespace, "marked"), timeout=60, message="the pod Ready")
    conditions = _pod(cluster, namespace, "marked")["status"]["conditions"]
    marked = [{**c, "status": "False"} if c["type"] == "Ready" else c for c in conditions]
    cluster.kubectl(
        "patch", "pod", "marked", f"--namespace={namespace}", "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": {"conditions": marked}}),
    )  # fmt: skip
    wait_for(partial(_is_ready, cluster, namespace, "marked"), timeout=30, message="the pod reported Ready again")
