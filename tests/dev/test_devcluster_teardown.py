"""Nothing outlives a cluster whose owner is stopped (SIGTERM) or killed outright (SIGKILL)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve_dev.cluster.processes import process_start_time, tracked_processes
from pdserve_dev.testing.cluster import leaked_listeners

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

OWNER = """
import sys, time
from pdserve_dev.cluster.cluster import LocalCluster
LocalCluster(sys.argv[1], topology="minimal", process_node=False).start()
print("READY", flush=True)
time.sleep(600)
"""


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


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
        assert len(pids) == 5 and all(_listening(p) for p in ports)

        owner.send_signal(sig)
        owner.wait(timeout=30)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(process_start_time(p) is not None for p in pids):
            time.sleep(0.1)
        assert [p for p in pids if process_start_time(p) is not None] == []
        # A killed process's sockets close as the kernel reaps it, a moment after its /proc entry changes: poll.
        while time.monotonic() < deadline and leaked_listeners(ports):
            time.sleep(0.2)
        assert leaked_listeners(ports) == []
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
