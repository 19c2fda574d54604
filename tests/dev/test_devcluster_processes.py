"""PID tracking: stop reaches a whole process group, and a reused PID is never signalled."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from pdserve_dev.cluster import processes
from pdserve_dev.cluster.cluster import kill_process_node_pods
from pdserve_dev.testing.net import free_ports
from pdserve_dev.testing.wait import wait_for


def _wait_gone(pid: int, timeout: float = 5.0) -> None:
    wait_for(lambda: processes.process_start_time(pid) is None, timeout=timeout, message=f"PID {pid} to exit")


def test_stop_terminates_the_process_and_its_children(tmp_path: Path) -> None:
    # The child forks a grandchild (same process group) and records its PID, then both sleep.
    script = (
        "import subprocess, time; p = subprocess.Popen(['sleep', '60']); "
        f"open({str(tmp_path / 'child')!r}, 'w').write(str(p.pid)); time.sleep(60)"
    )
    _proc, tracked = processes.spawn("sleeper", [sys.executable, "-c", script], tmp_path)
    child_file = tmp_path / "child"
    wait_for(child_file.exists, timeout=10, message="the child to record its grandchild's PID")
    grandchild = int(child_file.read_text())
    assert tracked.alive()
    assert [t.name for t in processes.tracked_processes(tmp_path / "pids")] == ["sleeper"]

    processes.stop_recorded(tmp_path / "pids", timeout=5)

    _wait_gone(tracked.pid)
    _wait_gone(grandchild)
    assert list((tmp_path / "pids").glob("*.pid")) == []


def test_a_pid_file_with_another_start_time_is_not_signalled(tmp_path: Path) -> None:
    stranger = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        start = processes.process_start_time(stranger.pid)
        assert start is not None
        pids = tmp_path / "pids"
        pids.mkdir()
        (pids / "00-old.pid").write_text(f"{stranger.pid} {start - 1}\n")
        processes.stop_recorded(pids, timeout=1)
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


def test_process_node_pod_pids_are_killed_only_when_younger_than_the_cluster(tmp_path: Path) -> None:
    before = subprocess.Popen(["sleep", "30"], start_new_session=True)
    time.sleep(0.05)
    cluster_start = processes.boot_ticks_now()
    time.sleep(0.05)
    pod = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        pids = tmp_path / "pids"
        pids.mkdir()
        (pids / "ns_old_c.pid").write_text(f"{before.pid}\n")
        (pids / "ns_pod_c.pid").write_text(f"{pod.pid}\n")
        killed = kill_process_node_pods(tmp_path, cluster_start)
        assert killed == [pod.pid]
        assert pod.wait(timeout=5) == -9
        assert before.poll() is None
    finally:
        for proc in (before, pod):
            proc.kill()
            proc.wait()


def test_free_ports_are_distinct_and_bindable() -> None:
    import socket

    ports = free_ports(5)
    assert len(set(ports)) == 5
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
    assert os.getpid() > 0
