"""`pdserve dev cluster up/status/kubeconfig/down` as a user runs them, as subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve_dev.cluster import build
from pdserve_dev.cluster.processes import process_start_time
from pdserve_dev.testing.cluster import leaked_listeners

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _pdserve(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "dev", "cluster", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def test_up_status_kubeconfig_down(tmp_path: Path) -> None:
    workdir = tmp_path / "cli-cluster"
    where = ["--workdir", str(workdir)]
    try:
        up = _pdserve("up", *where, "--topology", "minimal", "--no-process-node")
        assert up.returncode == 0, up.stdout + up.stderr
        assert "is up after" in up.stdout

        # `up` returned, yet the cluster keeps running without it.
        status = _pdserve("status", *where, "--json")
        assert status.returncode == 0, status.stdout + status.stderr
        info = json.loads(status.stdout)
        assert info["running"] is True
        assert info["nodes"] == {"total": 2, "ready": 2}
        names = {c["name"] for c in info["components"]}
        assert names == {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"}

        # A second `up` finds it running and leaves it alone.
        again_up = _pdserve("up", *where, "--topology", "minimal", "--no-process-node")
        assert again_up.returncode == 0 and "already running" in again_up.stdout

        kubeconfig = _pdserve("kubeconfig", *where)
        assert kubeconfig.returncode == 0
        path = Path(kubeconfig.stdout.strip())
        assert path.is_file()
        nodes = subprocess.run(
            [str(build.binary("kubectl")), f"--kubeconfig={path}", "get", "nodes", "--no-headers"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        assert len(nodes.splitlines()) == 2

        state = json.loads((workdir / "state.json").read_text())
        ports = [state[k] for k in ("etcd_port", "apiserver_port", "controller_manager_port", "scheduler_port")]
        pids = [c["pid"] for c in info["components"]]
    finally:
        down = _pdserve("down", *where)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "kube-apiserver" in down.stdout
    assert all(process_start_time(pid) is None for pid in pids)
    assert leaked_listeners(ports) == []

    after = _pdserve("status", *where)
    assert after.returncode == 1
    assert "running:    False" in after.stdout
    again = _pdserve("down", *where)
    assert again.returncode == 0 and "Nothing was running" in again.stdout
