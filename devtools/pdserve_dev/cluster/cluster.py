"""LocalCluster: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok and the process node.

Start-up order and what "ready" means (each step waits for the one before only where it must):

1. Stop whatever a previous run left in the workdir (PID files), wipe etcd's data, build missing binaries.
2. PKI and kubeconfigs (reused across runs of the same workdir), free loopback ports, the pod address plan.
3. etcd; wait for /health.
4. kube-apiserver; wait for /readyz (all post-start hooks done: RBAC bootstrap, priority classes, ...).
5. kube-controller-manager, kube-scheduler, kwok and the process node start together, while the harness
   creates the topology's Node objects.
6. Ready when: both controllers answer /healthz, the `default` ServiceAccount exists in `default` (so pods can
   be created), every simulated node is Ready (kwok took it over) and the process node, when asked for, is Ready.
7. With `prometheus=True` (or a later `start_prometheus()`): Prometheus, discovering the pods through the API
   server (see `prometheus`); ready when it answers /-/ready.

The cluster is real except the kubelets: every object goes through the real API server, admission, scheduler
and controllers. Nodes are kwok's fakes (pods turn Running with fake IPs) or the process node (pods run as
local processes). Teardown stops the process node first (so it can stop its pods gracefully), kills any pod
process it left behind, then everything else; see `processes` for how PIDs are tracked safely.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.util
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, cast

from pdserve_dev.cluster import build, pod_network, processes
from pdserve_dev.cluster import prometheus as prometheus_mod
from pdserve_dev.cluster.certs import Pki, generate_pki
from pdserve_dev.cluster.kubeconfig import write_kubeconfig
from pdserve_dev.cluster.topology import Topology, get_topology
from pdserve_dev.testing.net import free_ports

PROCESS_NODE_NAME = "process-node"
SYSTEM_NAMESPACE = "pdserve-system"
"""Where `helm install pdserve charts/pdserve -n pdserve-system` puts the operator; pinned to the process node."""
PROCESS_NODE_LABEL = "pdserve.io/process-node"
COMPONENT_PROMETHEUS = prometheus_mod.COMPONENT
PROCESS_NODE_MODULE = "pdserve_dev.process_node"
STATE_FILE = "state.json"


class ClusterError(RuntimeError):
    """The cluster could not start (the message says which component and shows the end of its log)."""


def default_workdir(name: str = "default") -> Path:
    """`$PDSERVE_CACHE_DIR/clusters/<name>`: where `pdserve dev cluster up` keeps a cluster's state."""
    return build.cache_root() / "clusters" / name


@dataclass
class ClusterState:
    """What `status` and `down` need to find a running cluster; saved as `<workdir>/state.json`."""

    workdir: str
    server: str
    kubeconfig: str
    topology: str
    process_node: bool
    bin_dir: str
    etcd_port: int
    etcd_peer_port: int
    apiserver_port: int
    controller_manager_port: int
    scheduler_port: int
    network: dict[str, Any]
    started_ticks: int
    """Boot-clock ticks when the cluster started: no process it owns can have started earlier."""
    startup_seconds: float = 0.0
    prometheus_port: int | None = None
    """Set while the cluster's Prometheus runs (http://127.0.0.1:<port>, inside the cluster's network namespace)."""

    @property
    def prometheus_url(self) -> str | None:
        return prometheus_mod.url_of(self.prometheus_port) if self.prometheus_port is not None else None

    def save(self) -> None:
        Path(self.workdir, STATE_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, workdir: Path) -> ClusterState | None:
        try:
            return cls(**json.loads((workdir / STATE_FILE).read_text()))
        except (OSError, ValueError, TypeError):
            return None


def _node_ready(node: Any) -> bool:
    """Ready condition True and none of the node lifecycle controller's taints left.

    The controller taints every new node `node.kubernetes.io/not-ready:NoSchedule` and lifts the taint a
    moment after the node reports Ready; until then the scheduler would keep pods off it.
    """
    conditions = (node.status.conditions if node.status is not None else None) or []
    taints = (node.spec.taints if node.spec is not None else None) or []
    lifecycle_taint = any(str(t.key).startswith("node.kubernetes.io/") for t in taints)
    return not lifecycle_taint and any(c.type == "Ready" and c.status == "True" for c in conditions)


def _log_tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


def _http_ok(url: str, context: ssl.SSLContext | None = None, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _insecure_context() -> ssl.SSLContext:
    # kube-controller-manager and kube-scheduler serve /healthz with a self-signed certificate they make at
    # start; on loopback, checking who answers adds nothing.
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def pinned_namespace(name: str) -> dict[str, Any]:
    """A Namespace whose pods run on the process node, whatever their own placement says nothing about.

    The way a cluster admin dedicates a node pool to a namespace: the PodNodeSelector admission plugin merges the
    namespace's node selector into every pod, PodTolerationRestriction its default tolerations (both plugins are
    enabled on the local API server). The local cluster creates `pdserve-system` like this, so the chart's
    operator pods land on the one node that runs them for real with no values of the local cluster's in the chart.
    """
    toleration = {"key": PROCESS_NODE_LABEL, "operator": "Exists", "effect": "NoSchedule"}
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": name,
            "annotations": {
                "scheduler.alpha.kubernetes.io/node-selector": f"{PROCESS_NODE_LABEL}=true",
                "scheduler.alpha.kubernetes.io/defaultTolerations": json.dumps([toleration]),
            },
        },
    }


def kill_process_node_pods(process_node_dir: Path, not_before_ticks: int) -> list[int]:
    """Kill (SIGKILL, whole process group) pod processes the process node recorded and did not stop.

    Its PID files hold a bare PID; a process that started before the cluster did cannot be one of its pods
    (the PID was reused), so it is spared.
    """
    killed = []
    for pid_file in sorted((process_node_dir / "pids").glob("*.pid")):
        try:
            pid = int(pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        start = processes.process_start_time(pid)
        if start is not None and start >= not_before_ticks:
            for kill in (os.killpg, os.kill):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    kill(pid, signal.SIGKILL)
                    break
            killed.append(pid)
        pid_file.unlink(missing_ok=True)
    return killed


def stop_workdir(workdir: Path, timeout: float = 15.0) -> list[str]:
    """Stop every process recorded in `workdir` (also after a crash of whoever started them); return their names."""
    state = ClusterState.load(workdir)
    pids_dir = workdir / "pids"
    recorded = processes.tracked_processes(pids_dir)
    stopped = [t.name for t in recorded if t.alive()]
    # The process node first and alone, so it can stop its pods within their grace period.
    process_node = [t for t in recorded if t.name == PROCESS_NODE_NAME]
    processes.stop(process_node, timeout)
    not_before = state.started_ticks if state is not None else 0
    kill_process_node_pods(workdir / PROCESS_NODE_NAME, not_before)
    processes.stop(list(reversed([t for t in recorded if t.name != PROCESS_NODE_NAME])), timeout)
    return stopped


class LocalCluster:
    """A local cluster as a context manager (or `start()`/`stop()`); see the module docstring.

    `detach=True` is for `pdserve dev cluster up`: processes survive this Python process and are stopped with
    `stop_workdir` later. Otherwise they are tied to it: stopped on exit, on SIGTERM/SIGHUP, by atexit, and by
    the kernel (parent-death signal) if this process is killed outright.
    """

    def __init__(
        self,
        workdir: Path | str,
        topology: Topology | str = "default",
        process_node: bool = False,
        *,
        prometheus: bool = False,
        image_map: Path | None = None,
        detach: bool = False,
        ready_timeout: float = 90.0,
        use_local_route: bool = True,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.workdir = Path(workdir).resolve()
        self.topology = get_topology(topology) if isinstance(topology, str) else topology
        self.process_node = process_node
        self.prometheus = prometheus
        self.image_map = image_map
        self.detach = detach
        self.ready_timeout = ready_timeout
        self.use_local_route = use_local_route
        self._log = log or (lambda message: None)
        self.state: ClusterState | None = None
        self._popen: dict[str, subprocess.Popen[bytes]] = {}
        self._stopped = threading.Event()
        self._previous_handlers: dict[int, Any] = {}
        self._hooks_installed = False
        self.timings: dict[str, float] = {}

    @classmethod
    def attach(cls, workdir: Path | str, *, log: Callable[[str], None] | None = None) -> LocalCluster:
        """The cluster already running in `workdir` (started detached, by `pdserve dev cluster up`), to add
        Prometheus to it with `start_prometheus()`. What is started this way is detached too: `down` stops it.
        """
        directory = Path(workdir).resolve()
        state = ClusterState.load(directory)
        if state is None:
            raise ClusterError(f"No cluster in {directory} (no {STATE_FILE})")
        # The topology only matters for starting nodes, which an attached cluster never does.
        local = cls(directory, topology="none", process_node=state.process_node, detach=True, log=log)
        local.state = state
        return local

    # -- public surface ---------------------------------------------------------------------------------

    @property
    def kubeconfig(self) -> Path:
        """The admin (cluster-admin) kubeconfig."""
        return self.workdir / "kubeconfig"

    @property
    def process_node_workdir(self) -> Path:
        """The process node's workdir: `logs/<namespace>_<pod>_<container>.log`, `pids/*.pid`."""
        return self.workdir / PROCESS_NODE_NAME

    @property
    def logs_dir(self) -> Path:
        """Logs of etcd, kube-apiserver, ... one file per component."""
        return self.workdir / "logs"

    @property
    def network(self) -> pod_network.PodNetwork:
        if self.state is None:
            raise ClusterError("The cluster is not started")
        return pod_network.PodNetwork(**self.state.network)

    @property
    def prometheus_paths(self) -> prometheus_mod.PrometheusPaths:
        """Prometheus' config, data and file_sd folder (`<workdir>/prometheus`)."""
        return prometheus_mod.PrometheusPaths(self.workdir)

    @property
    def prometheus_url(self) -> str | None:
        """The URL of the cluster's Prometheus while it runs (see `start_prometheus`)."""
        return self.state.prometheus_url if self.state is not None else None

    def kubectl_command(self, *args: str) -> list[str]:
        """argv for kubectl against this cluster."""
        return [str(build.binary("kubectl")), f"--kubeconfig={self.kubeconfig}", *args]

    def helm_command(self, *args: str) -> list[str]:
        """argv for helm (built with the cluster's binaries) against this cluster."""
        return [str(build.binary("helm")), f"--kubeconfig={self.kubeconfig}", *args]

    def api_client(self) -> Any:
        """A new `kubernetes.client.ApiClient` for the admin user (close it, or use it as a context manager)."""
        from pdserve.api.kubeclient import new_api_client  # lazy: the kubernetes client is slow to import

        return new_api_client(self.kubeconfig)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- start ------------------------------------------------------------------------------------------

    def start(self) -> LocalCluster:
        """Start everything and return once the cluster is ready; on failure stop what started and raise."""
        started = time.monotonic()
        for attempt in range(1, 4):
            try:
                self._start()
                break
            except ClusterError as exc:
                # Ports are picked free, then bound by another process a moment later; on a machine shared
                # with other test runs, someone may take one in between. Start over with new ports.
                if attempt < 3 and "address already in use" in str(exc):
                    self._log(f"A port was taken before {self.workdir.name} could bind it; retrying")
                    self._stop_processes()
                    continue
                self.stop()
                raise
            except BaseException:
                self.stop()
                raise
        assert self.state is not None
        self.state.startup_seconds = round(time.monotonic() - started, 2)
        self.state.save()
        self._log(f"Cluster ready in {self.state.startup_seconds:.1f}s ({self._timing_summary()})")
        return self

    def _timing_summary(self) -> str:
        return ", ".join(f"{k} {v:.1f}s" for k, v in self.timings.items())

    def _mark(self, step: str, since: float) -> float:
        now = time.monotonic()
        self.timings[step] = now - since
        return now

    def _start(self) -> None:
        t = time.monotonic()
        self.workdir.mkdir(parents=True, exist_ok=True)
        leftovers = stop_workdir(self.workdir)
        if leftovers:
            self._log(f"Stopped leftovers of a previous run in {self.workdir}: {', '.join(leftovers)}")
        if self.process_node and importlib.util.find_spec(f"{PROCESS_NODE_MODULE}.__main__") is None:
            raise ClusterError(
                f"process_node=True needs the module {PROCESS_NODE_MODULE} (run as `python -m "
                f"{PROCESS_NODE_MODULE}`), which this checkout does not have yet"
            )
        bin_dir = build.ensure_binaries(log=self._log)
        shutil.rmtree(self.workdir / "etcd-data", ignore_errors=True)
        shutil.rmtree(self.process_node_workdir, ignore_errors=True)
        network, warning = pod_network.plan(self.use_local_route)
        if warning:
            self._log(f"WARNING: {warning}")
        pki = generate_pki(self.workdir / "pki", network.service_ip)
        etcd_port, etcd_peer, api_port, kcm_port, sched_port = free_ports(5)
        server = f"https://127.0.0.1:{api_port}"
        kubeconfigs = {
            stem: write_kubeconfig(self.workdir / "kubeconfigs" / f"{stem}.kubeconfig", server, pki, stem)
            for stem in ("controller-manager", "scheduler", "kwok", "process-node", "prometheus")
        }
        write_kubeconfig(self.kubeconfig, server, pki, "admin")
        self.state = ClusterState(
            workdir=str(self.workdir),
            server=server,
            kubeconfig=str(self.kubeconfig),
            topology=self.topology.name,
            process_node=self.process_node,
            bin_dir=str(bin_dir),
            etcd_port=etcd_port,
            etcd_peer_port=etcd_peer,
            apiserver_port=api_port,
            controller_manager_port=kcm_port,
            scheduler_port=sched_port,
            network=asdict(network),
            started_ticks=processes.boot_ticks_now(),
        )
        self.state.save()
        if not self.detach:
            self._install_cleanup_hooks()
        t = self._mark("prepare", t)

        self._spawn("etcd", self._etcd_args(bin_dir))
        self._wait("etcd", lambda: _http_ok(f"http://127.0.0.1:{etcd_port}/health"), 30)
        t = self._mark("etcd", t)

        ca = ssl.create_default_context(cafile=str(pki.ca_cert))
        self._spawn("kube-apiserver", self._apiserver_args(bin_dir, pki, network))
        self._wait("kube-apiserver", lambda: _http_ok(f"{server}/readyz", ca), 60)
        t = self._mark("kube-apiserver", t)

        self._spawn("kube-controller-manager", self._controller_manager_args(bin_dir, pki, kubeconfigs))
        self._spawn("kube-scheduler", self._scheduler_args(bin_dir, kubeconfigs))
        self._spawn("kwok", self._kwok_args(bin_dir, kubeconfigs, network))
        if self.process_node:
            self._spawn_process_node(kubeconfigs["process-node"], network)
        with self.api_client() as api:
            self._create_nodes(api, network)
            insecure = _insecure_context()
            self._wait(
                "kube-controller-manager",
                lambda: _http_ok(f"https://127.0.0.1:{kcm_port}/healthz", insecure),
                30,
            )
            self._wait("kube-scheduler", lambda: _http_ok(f"https://127.0.0.1:{sched_port}/healthz", insecure), 30)
            self._wait("kube-controller-manager", lambda: self._default_service_account(api), 30)
            t = self._mark("controllers", t)
            simulated = {node.name for node in self.topology.nodes()}
            self._wait("kwok", lambda: simulated <= self._ready_nodes(api), self.ready_timeout)
            if self.process_node:
                self._wait(PROCESS_NODE_NAME, lambda: PROCESS_NODE_NAME in self._ready_nodes(api), self.ready_timeout)
                self._create_system_namespace(api)
            t = self._mark("nodes", t)
        if self.prometheus:
            self._start_prometheus()
            self._mark("prometheus", t)

    # -- faults ---------------------------------------------------------------------------------------------

    def stop_apiserver(self, timeout: float = 15.0) -> None:
        """Stop kube-apiserver (SIGTERM, SIGKILL after `timeout`), by the PID this cluster recorded for it.

        For fault tests (the chaos benchmark): clients lose their watches and every request is refused until
        `start_apiserver`; etcd and the rest of the cluster keep running, so nothing is lost meanwhile.
        """
        recorded = [t for t in processes.tracked_processes(self.workdir / "pids") if t.name == "kube-apiserver"]
        if not recorded:
            raise ClusterError("This cluster has no kube-apiserver running")
        processes.stop(recorded, timeout)
        old = self._popen.pop("kube-apiserver", None)
        if old is not None:
            with contextlib.suppress(Exception):
                old.wait(timeout=1)

    def start_apiserver(self, timeout: float = 60.0) -> None:
        """Start kube-apiserver again after `stop_apiserver`, on the same port with the same PKI and etcd;
        return once it answers /readyz."""
        if self.state is None:
            raise ClusterError("The cluster is not started")
        pki = Pki(self.workdir / "pki")
        self._spawn("kube-apiserver", self._apiserver_args(Path(self.state.bin_dir), pki, self.network))
        ca, server = ssl.create_default_context(cafile=str(pki.ca_cert)), self.state.server
        self._wait("kube-apiserver", lambda: _http_ok(f"{server}/readyz", ca), timeout)

    # -- Prometheus -----------------------------------------------------------------------------------------

    def start_prometheus(self, timeout: float = 60.0) -> str:
        """Start the cluster's Prometheus if it does not run yet (building it if needed); return its URL.

        For a cluster started without `prometheus=True`, e.g. by the test session before any test asked for
        Prometheus. It stops with the cluster either way.
        """
        if self.state is None:
            raise ClusterError("The cluster is not started")
        running = self.prometheus_url
        # Checked by PID file, not by our own child: an attached cluster's Prometheus may be another process's.
        recorded = processes.tracked_processes(self.workdir / "pids")
        alive = any(t.name == COMPONENT_PROMETHEUS and t.alive() for t in recorded)
        if running is not None and alive:
            return running
        self._start_prometheus(timeout)
        url = self.prometheus_url
        assert url is not None
        return url

    def _start_prometheus(self, timeout: float = 60.0) -> None:
        assert self.state is not None
        binary = build.ensure_binaries(build.PROMETHEUS_BINARIES, log=self._log) / "prometheus"
        with self.api_client() as api:
            prometheus_mod.apply_rbac(api)
        paths = self.prometheus_paths
        prometheus_mod.write_config(paths, self.workdir / "kubeconfigs" / "prometheus.kubeconfig")
        for attempt in range(1, 4):
            (port,) = free_ports(1)
            self._spawn(COMPONENT_PROMETHEUS, prometheus_mod.argv(binary, paths, port))
            url = prometheus_mod.url_of(port)
            try:
                self._wait(COMPONENT_PROMETHEUS, functools.partial(prometheus_mod.ready, url), timeout)
                break
            except ClusterError as exc:
                # The free port was taken before Prometheus bound it (see `start`): forget the dead process
                # (so `status` does not report a stopped component) and try another port.
                if attempt == 3 or "address already in use" not in str(exc):
                    raise
                self._popen.pop(COMPONENT_PROMETHEUS).wait()
                for tracked in processes.tracked_processes(self.workdir / "pids"):
                    if tracked.name == COMPONENT_PROMETHEUS and not tracked.alive():
                        tracked.pid_file.unlink(missing_ok=True)
        self.state.prometheus_port = port
        self.state.save()
        self._log(f"Prometheus is ready at {url}")

    # -- component command lines --------------------------------------------------------------------------

    def _etcd_args(self, bin_dir: Path) -> list[str]:
        assert self.state is not None
        client = f"http://127.0.0.1:{self.state.etcd_port}"
        peer = f"http://127.0.0.1:{self.state.etcd_peer_port}"
        return [
            str(bin_dir / "etcd"),
            "--name=pdserve",
            f"--data-dir={self.workdir / 'etcd-data'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=pdserve={peer}",
            "--initial-cluster-state=new",
            # A throw-away test store: skipping fsync makes writes ~10x cheaper on a shared disk.
            "--unsafe-no-fsync=true",
            "--log-level=warn",
        ]

    def _apiserver_args(self, bin_dir: Path, pki: Pki, network: pod_network.PodNetwork) -> list[str]:
        assert self.state is not None
        return [
            str(bin_dir / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{self.state.etcd_port}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={self.state.apiserver_port}",
            f"--cert-dir={self.workdir / 'apiserver-certs'}",
            f"--tls-cert-file={pki.apiserver_cert}",
            f"--tls-private-key-file={pki.apiserver_key}",
            f"--client-ca-file={pki.ca_cert}",
            f"--service-account-key-file={pki.service_account_pub}",
            f"--service-account-signing-key-file={pki.service_account_key}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-cluster-ip-range={network.service_cidr}",
            "--authorization-mode=Node,RBAC",
            # Pods that request nvidia.com/gpu get a toleration for the GPU nodes' taint, as on managed clusters;
            # namespaces may pin their pods to a node pool (see pinned_namespace).
            "--enable-admission-plugins=ExtendedResourceToleration,PodNodeSelector,PodTolerationRestriction",
            "--allow-privileged=true",
            # The `kubernetes` Service's endpoint would be 127.0.0.1, which Endpoints validation rejects.
            "--endpoint-reconciler-type=none",
            "--profiling=false",
            "--v=0",
        ]

    def _controller_manager_args(self, bin_dir: Path, pki: Pki, kubeconfigs: dict[str, Path]) -> list[str]:
        assert self.state is not None
        kubeconfig = kubeconfigs["controller-manager"]
        return [
            str(bin_dir / "kube-controller-manager"),
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.state.controller_manager_port}",
            f"--cert-dir={self.workdir / 'controller-manager-certs'}",
            # Every default controller (Deployments, StatefulSets, EndpointSlices, GC, PDB via disruption,
            # node lifecycle, namespaces, service accounts, ...), each with its own service-account identity.
            "--controllers=*",
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki.service_account_key}",
            f"--root-ca-file={pki.ca_cert}",
            f"--cluster-signing-cert-file={pki.ca_cert}",
            f"--cluster-signing-key-file={pki.ca_key}",
            "--cluster-name=pdserve-dev",
            # Client-side rate limits sized for one user on loopback, not a shared production API server: at the
            # default 20 QPS the node lifecycle controller needs ~25 s to lift the not-ready taints of 128 nodes.
            "--kube-api-qps=500",
            "--kube-api-burst=1000",
            # One instance: no leader election, so a restart does not wait for the old lease to expire.
            "--leader-elect=false",
            "--v=0",
        ]

    def _scheduler_args(self, bin_dir: Path, kubeconfigs: dict[str, Path]) -> list[str]:
        assert self.state is not None
        kubeconfig = kubeconfigs["scheduler"]
        return [
            str(bin_dir / "kube-scheduler"),
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.state.scheduler_port}",
            f"--cert-dir={self.workdir / 'scheduler-certs'}",
            "--kube-api-qps=500",
            "--kube-api-burst=1000",
            "--leader-elect=false",
            "--v=0",
        ]

    def _kwok_args(self, bin_dir: Path, kubeconfigs: dict[str, Path], network: pod_network.PodNetwork) -> list[str]:
        stages = self.workdir / "kwok-stages.yaml"
        stages.write_text(resources.files("pdserve_dev.cluster").joinpath("kwok-stages.yaml").read_text())
        return [
            str(bin_dir / "kwok"),
            f"--kubeconfig={kubeconfigs['kwok']}",
            f"--config={stages}",
            "--manage-all-nodes=false",
            # Only the simulated GPU nodes; the process node is its own kubelet.
            "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
            f"--cidr={network.kwok_pod_cidr}",
            f"--node-ip={network.kwok_node_ip}",
            "--node-lease-duration-seconds=40",
        ]

    def _spawn_process_node(self, kubeconfig: Path, network: pod_network.PodNetwork) -> None:
        argv = [
            sys.executable,
            "-m",
            PROCESS_NODE_MODULE,
            f"--kubeconfig={kubeconfig}",
            f"--node-name={PROCESS_NODE_NAME}",
            f"--workdir={self.process_node_workdir}",
        ]
        if self.image_map is not None:
            argv.append(f"--image-map={self.image_map}")
        env = dict(os.environ)
        if network.process_node_cidr is not None:
            env["PDSERVE_POD_CIDR"] = network.process_node_cidr
        self.process_node_workdir.mkdir(parents=True, exist_ok=True)
        self._spawn(PROCESS_NODE_NAME, argv, env)

    # -- helpers ------------------------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        # If this Python process dies without running stop(), the kernel ends the children: the control plane
        # with SIGKILL, the process node with SIGTERM so that it still stops the pod processes it started.
        death_signal = signal.SIGTERM if name == PROCESS_NODE_NAME else signal.SIGKILL
        proc, _ = processes.spawn(
            name, argv, self.workdir, env=env, parent_death_signal=None if self.detach else death_signal
        )
        self._popen[name] = proc

    def _wait(self, name: str, ready: Callable[[], bool], timeout: float) -> None:
        """Poll `ready` until true; fail early, with the log's tail, if the component exits."""
        deadline = time.monotonic() + timeout
        delay = 0.05
        while True:
            for component, proc in self._popen.items():
                if proc.poll() is not None:
                    raise ClusterError(
                        f"{component} exited with status {proc.returncode} while waiting for {name}; "
                        f"end of {self.logs_dir / (component + '.log')}:\n"
                        f"{_log_tail(self.logs_dir / (component + '.log'))}"
                    )
            with contextlib.suppress(Exception):
                if ready():
                    return
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"{name} was not ready after {timeout:.0f}s; end of its log:\n"
                    f"{_log_tail(self.logs_dir / (name + '.log'))}"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    def _create_nodes(self, api: Any, network: pod_network.PodNetwork) -> None:
        from kubernetes import client

        core = client.CoreV1Api(api)
        for node in self.topology.node_objects(network.kwok_pod_cidr):
            core.create_node(cast(Any, node))  # the client accepts plain dicts as bodies

    @staticmethod
    def _create_system_namespace(api: Any) -> None:
        from kubernetes import client

        client.CoreV1Api(api).create_namespace(cast(Any, pinned_namespace(SYSTEM_NAMESPACE)))

    @staticmethod
    def _default_service_account(api: Any) -> bool:
        from kubernetes import client

        client.CoreV1Api(api).read_namespaced_service_account("default", "default")
        return True

    @staticmethod
    def _ready_nodes(api: Any) -> set[str]:
        from kubernetes import client

        nodes: list[Any] = client.CoreV1Api(api).list_node().items
        return {str(node.metadata.name) for node in nodes if _node_ready(node)}

    def _install_cleanup_hooks(self) -> None:
        if self._hooks_installed:
            return
        self._hooks_installed = True
        atexit.register(self.stop)
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                self._previous_handlers[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Turn SIGTERM/SIGHUP into an exception so `with` blocks and pytest fixtures unwind and run stop().
        raise SystemExit(128 + signum)

    # -- stop -------------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop every process of this cluster (idempotent); logs and PKI stay in the workdir."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if not self.detach:
            with contextlib.suppress(Exception):
                atexit.unregister(self.stop)
            for sig, handler in self._previous_handlers.items():
                with contextlib.suppress(ValueError):
                    signal.signal(sig, handler)
        self._stop_processes()

    def _stop_processes(self) -> None:
        stop_workdir(self.workdir)
        for proc in self._popen.values():
            with contextlib.suppress(Exception):
                proc.wait(timeout=1)
        self._popen.clear()


@dataclass
class ComponentStatus:
    name: str
    pid: int
    alive: bool


def cluster_status(workdir: Path) -> dict[str, Any]:
    """A summary of the cluster in `workdir`: processes, API readiness, nodes (for `pdserve dev cluster status`)."""
    state = ClusterState.load(workdir)
    if state is None:
        return {"workdir": str(workdir), "running": False, "reason": f"no {STATE_FILE}"}
    components = [
        asdict(ComponentStatus(t.name, t.pid, t.alive())) for t in processes.tracked_processes(workdir / "pids")
    ]
    prometheus_url = state.prometheus_url
    prometheus_alive = any(c["name"] == COMPONENT_PROMETHEUS and c["alive"] for c in components)
    ca = ssl.create_default_context(cafile=str(workdir / "pki" / "ca.crt"))
    api_ready = _http_ok(f"{state.server}/readyz", ca)
    nodes: dict[str, int] = {}
    if api_ready:
        from kubernetes import client

        from pdserve.api.kubeclient import new_api_client

        with new_api_client(state.kubeconfig) as api:
            items = client.CoreV1Api(api).list_node().items
            nodes = {"total": len(items), "ready": sum(_node_ready(n) for n in items)}
    return {
        "workdir": str(workdir),
        "running": api_ready and bool(components) and all(c["alive"] for c in components),
        "server": state.server,
        "kubeconfig": state.kubeconfig,
        "topology": state.topology,
        "process_node": state.process_node,
        "api_ready": api_ready,
        "components": components,
        "nodes": nodes,
        "startup_seconds": state.startup_seconds,
        "prometheus": {
            "url": prometheus_url,
            "ready": prometheus_alive and prometheus_url is not None and prometheus_mod.ready(prometheus_url),
        }
        if prometheus_url is not None
        else None,
    }


def iter_cluster_workdirs() -> Iterator[Path]:
    """Workdirs under the default clusters folder that hold a state file."""
    root = build.cache_root() / "clusters"
    if root.is_dir():
        yield from (p for p in sorted(root.iterdir()) if (p / STATE_FILE).exists())
