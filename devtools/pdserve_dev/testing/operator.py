"""Run `pdserve operator` as a real subprocess and read its metrics: shared by the cluster tests and the benchmark.

Kept in the package (not under tests/) so `bench/operator_bench.py` can use it too. It only ever stops the process
it started, by PID, and binds the metrics and health servers to loopback ports it picked.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from pdserve_dev.testing.metrics import samples, scrape_sync
from pdserve_dev.testing.net import free_port
from pdserve_dev.testing.wait import WaitTimeoutError, wait_for

CPU_NODE = "pdserve-operator-tests-cpu"


class OperatorProcess:
    """One operator process: start, wait until it leads (or not), scrape, stop/kill."""

    def __init__(
        self,
        kubeconfig: Path | str,
        log_path: Path,
        *,
        namespaces: Sequence[str] = (),
        identity: str = "op",
        lease_name: str = "pdserve-operator",
        lease_namespace: str = "default",
        extra: Sequence[str] = (),
    ) -> None:
        self.kubeconfig, self.log_path = Path(kubeconfig), log_path
        self.namespaces, self.identity = list(namespaces), identity
        self.lease_name, self.lease_namespace, self.extra = lease_name, lease_namespace, list(extra)
        self.metrics_port = self.health_port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        scope = [arg for ns in self.namespaces for arg in ("--namespace", ns)] or ["--all-namespaces"]
        return [
            sys.executable,
            "-m",
            "pdserve.cli",
            "operator",
            "--kubeconfig",
            str(self.kubeconfig),
            *scope,
            "--bind",
            "127.0.0.1",
            "--metrics-port",
            str(self.metrics_port),
            "--health-port",
            str(self.health_port),
            "--identity",
            self.identity,
            "--lease-name",
            self.lease_name,
            "--lease-namespace",
            self.lease_namespace,
            "--log-format",
            "text",
            *self.extra,
        ]

    def start(self) -> OperatorProcess:
        self.metrics_port, self.health_port = free_port(), free_port()
        log = self.log_path.open("ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        return self

    def __enter__(self) -> OperatorProcess:
        return self.start()

    def __exit__(self, *exc: object | TracebackType | None) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM (the operator releases its lease), then SIGKILL if it does not exit in time."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    def kill(self) -> None:
        """SIGKILL: a crash, no lease release, no cleanup."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    # ------------------------------------------------------------------------------------------------- probes

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def exposition(self) -> str:
        """The operator's /metrics as Prometheus scrapes it (read it with `pdserve_dev.testing.metrics`)."""
        return scrape_sync(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5)

    def metrics(self) -> dict[str, float]:
        """Every sample as `name{label="v",...}` -> value (labels sorted), e.g. `pdserve_operator_leader`."""
        return samples(self.exposition())

    def total(self, prefix: str) -> float:
        """Sum of every sample whose name starts with `prefix` (e.g. all label sets of a counter)."""
        return sum(value for key, value in self.metrics().items() if key.startswith(prefix))

    def writes(self) -> float:
        return self.total("pdserve_operator_writes_total{")

    def reconciles(self, result: str | None = None) -> float:
        """Finished reconcile passes (`pdserve_operator_reconciles_total`): all of them, or those of one `result`
        (noop, status, applied, invalid, gone, error, not_leader)."""
        if result is None:
            return self.total("pdserve_operator_reconciles_total{")
        return self.metrics().get(f'pdserve_operator_reconciles_total{{result="{result}"}}', 0.0)

    def wait_reconciles(self, passes: int, result: str | None = None, timeout: float = 60.0) -> float:
        """Wait until `passes` more passes (of `result`, when given) have finished; returns the new count.

        This is the counted event a test waits for before asserting that something did *not* happen ("no writes",
        "not pruned"): with it, the assertion covers that many passes whatever the machine's speed, where a sleep
        would cover an unknown number of them, possibly none."""
        target = self.reconciles(result) + passes
        return wait_for(
            lambda: (count := self.reconciles(result)) >= target and count,
            timeout,
            message=lambda: f"{passes} more reconcile passes (result={result or 'any'}); log:\n{self.log_tail(20)}",
        )

    def wait_quiet(self, passes: int, timeout: float = 90.0) -> None:
        """Wait until `passes` consecutive passes finished without a single write: the operator has settled (the
        trailing status updates of a rollout are done). Times out if every window of passes writes something."""
        deadline = time.monotonic() + timeout
        while True:
            writes = self.writes()
            try:
                self.wait_reconciles(passes, timeout=max(0.0, deadline - time.monotonic()))
            except WaitTimeoutError:
                raise WaitTimeoutError(
                    f"no {passes} passes in a row without a write within {timeout:.0f}s (writes went from "
                    f"{writes:.0f} to {self.writes():.0f}); log:\n{self.log_tail(20)}"
                ) from None
            if self.writes() == writes:
                return

    def is_leader(self) -> bool:
        try:
            return self.metrics().get("pdserve_operator_leader") == 1.0
        except OSError:
            return False

    def wait_ready(self, timeout: float = 60.0, leader: bool = True) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"operator exited early; log:\n{self.log_tail()}")
            if self.healthy() and (not leader or self.is_leader()):
                return
            time.sleep(0.3)
        raise TimeoutError(f"operator not ready after {timeout}s; log:\n{self.log_tail()}")

    def rss_bytes(self) -> int:
        """Resident set size from /proc (Linux)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def ensure_cpu_node(cluster: Any, name: str = CPU_NODE, pods: int = 110, cidr: str = "10.250.250.0/24") -> None:
    """An untainted kwok node for router pods (every simulated GPU node carries the GPU taint). `cluster` is a
    pdserve_dev.testing.cluster.ClusterHelper."""
    if cluster.kubectl("get", "node", name, check=False).returncode == 0:
        return
    capacity = {"cpu": "256", "memory": "1Ti", "pods": str(pods)}
    node = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/hostname": name, "type": "kwok", "topology.kubernetes.io/zone": "zone-a"},
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {"podCIDR": cidr, "podCIDRs": [cidr]},
        "status": {"capacity": capacity, "allocatable": dict(capacity)},
    }
    cluster.kubectl("create", "-f", "-", input=json.dumps(node))
