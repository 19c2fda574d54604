"""Nothing outlives a cluster whose owner is stopped (SIGTERM) or killed outright (SIGKILL)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve_dev.cluster.processes import process_start_time, tracked_processes
from pdserve_dev.testing.cluster import leaked_listeners
from pdserve_dev.testing.net import listening
from pdserve_dev.testing.wait import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

OWNER = """
import sys, time
from pdserve_dev.cluster.cluster import LocalCluster
LocalCluster(sys.argv[1], topology="minimal", process_node=False).start()
print("READY", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_no_process_or_port_survives_the_owner(tmp_path: Path, sig: signal.Signals) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert owner.stdout is not None
        first = owner.stdout.readline()
        assert first.strip() == "READY", first + owner.stdout.read()
        pids = [t.pid for t in tracked_processes(tmp_path / "pids")]
        state = json.loads((tmp_path / "state.json").read_text())
        ports = [state[k] for k in ("etcd_port", "apiserver_port", "controller_manager_port", "scheduler_port")]
        assert len(pids) == 5 and all(listening(p) for p in ports)

        owner.send_signal(sig)
        owner.wait(timeout=30)

        def survivors() -> list[int]:
            return [p for p in pids if process_start_time(p) is not None]

        wait_for(lambda: not survivors(), timeout=20, message=lambda: f"the cluster to exit, alive: {survivors()}")
        # A killed process's sockets close as the kernel reaps it, a moment after its /proc entry changes: wait.
        wait_for(
            lambda: not leaked_listeners(ports),
            timeout=20,
            message=lambda: f"cluster ports to close, still listening: {leaked_listeners(ports)}",
        )
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
