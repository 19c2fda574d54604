"""The process node's local parts with real processes and sockets: container processes, probes, testserver."""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve_dev.process_node.probes import ProbeSpec, run_probe
from pdserve_dev.process_node.process import LocalProcess, kill_stale
from pdserve_dev.process_node.volumes import materialise
from pdserve_dev.testing.wait import wait_for

IP = "127.31.0.7"  # a loopback address of its own, as a pod would get
CHILD_SECONDS = 60  # how long the stubborn child below would live on its own


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill 0; it is gone for our purposes.
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"


@pytest.fixture
def testserver(tmp_path: Path) -> Iterator[LocalProcess]:
    env = dict(os.environ, PDSERVE_BIND_HOST=IP, POD_NAME="web-3")
    process = LocalProcess.start(
        [sys.executable, "-m", "pdserve_dev.process_node.testserver", "--port", "18080"],
        env=env,
        cwd=tmp_path,
        log_path=tmp_path / "logs" / "c.log",
        pid_path=tmp_path / "pids" / "c.pid",
    )
    try:
        spec = ProbeSpec.from_container("readiness", {"httpGet": {"port": 18080, "path": "/readyz"}})
        wait_for(lambda: run_probe(spec, {}, IP)[0])
        yield process
    finally:
        process.stop(grace=5)


def _request(method: str, path: str) -> tuple[int, dict[str, object]]:
    connection = http.client.HTTPConnection(IP, 18080, timeout=5)
    try:
        connection.request(method, path)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_testserver_binds_the_pod_ip_and_probes_follow_its_state(testserver: LocalProcess, tmp_path: Path) -> None:
    assert _request("GET", "/") == (200, {"pod": "web-3", "ip": IP, "port": 18080})
    # Bound to the pod IP only: another loopback address has no listener on that port.
    with pytest.raises(OSError):
        http.client.HTTPConnection("127.31.0.8", 18080, timeout=2).request("GET", "/")
    readiness = ProbeSpec.from_container("readiness", {"httpGet": {"port": "web", "path": "/readyz"}})
    container = {"ports": [{"name": "web", "containerPort": 18080}]}
    assert run_probe(readiness, container, IP) == (True, "")
    _request("POST", "/ready?ok=false")
    ok, why = run_probe(readiness, container, IP)
    assert not ok and "503" in why
    tcp = ProbeSpec.from_container("liveness", {"tcpSocket": {"port": 18080}})
    assert run_probe(tcp, {}, IP)[0]
    assert not run_probe(tcp, {}, "127.31.0.9")[0]
    assert (tmp_path / "pids" / "c.pid").read_text().strip() == str(testserver.pid)


def test_stop_terminates_the_group_and_removes_the_pid_file(tmp_path: Path) -> None:
    pid_path = tmp_path / "pids" / "p.pid"
    log_path = tmp_path / "logs" / "p.log"
    # A shell that ignores SIGTERM and has a child: both must be gone after stop().
    script = f"trap '' TERM; sleep {CHILD_SECONDS} & echo child=$!; wait"
    child_line = re.compile(r"^child=(\d+)$", re.MULTILINE)
    process = LocalProcess.start(
        ["sh", "-c", script], env=dict(os.environ), cwd=tmp_path, log_path=log_path, pid_path=pid_path
    )
    wait_for(lambda: child_line.search(log_path.read_text()) is not None)
    match = child_line.search(log_path.read_text())
    assert match is not None
    child = int(match.group(1))
    assert pid_path.exists() and _alive(child)
    grace = 0.5
    started = time.monotonic()
    code = process.stop(grace=grace)
    # It waited out the grace period (timer slack aside) and then killed, not waited for the child's sleep:
    # bounds relative to the two durations, with tens of seconds of margin for a loaded machine.
    assert 0.8 * grace < time.monotonic() - started < CHILD_SECONDS / 4
    assert code == 137  # SIGKILL after the grace period
    assert not pid_path.exists()
    wait_for(lambda: not _alive(child))
    assert log_path.read_text().startswith("--- process-node:")


def test_exit_code_and_log_are_kept_across_runs(tmp_path: Path) -> None:
    for word in ("first", "second"):
        process = LocalProcess.start(
            ["sh", "-c", f"echo {word}; exit 3"],
            env=dict(os.environ),
            cwd=tmp_path,
            log_path=tmp_path / "x.log",
            pid_path=tmp_path / "x.pid",
        )
        wait_for(process.poll, message="the process to exit")  # poll() is its exit code (3)
        assert process.poll() == 3
    text = (tmp_path / "x.log").read_text()
    assert text.index("first") < text.index("second")
    assert text.count("--- process-node:") == 2
    assert not (tmp_path / "x.pid").exists()


def test_kill_stale_kills_only_session_leaders(tmp_path: Path) -> None:
    leader = subprocess.Popen(["sleep", "60"], start_new_session=True)
    other = subprocess.Popen(["sleep", "60"])  # same session as pytest: must survive
    try:
        (tmp_path / "a.pid").write_text(f"{leader.pid}\n")
        (tmp_path / "b.pid").write_text(f"{other.pid}\n")
        kill_stale(tmp_path / "a.pid")
        kill_stale(tmp_path / "b.pid")
        assert leader.wait(timeout=5) == -9
        assert other.poll() is None
        assert not list(tmp_path.glob("*.pid"))
    finally:
        for process in (leader, other):
            process.kill()
            process.wait()


class _Objects:
    def configmap_data(self, namespace: str, name: str) -> dict[str, str] | None:
        return {"router.yaml": "port: 80\n", "other": "x"} if name == "cfg" else None

    def secret_data(self, namespace: str, name: str) -> dict[str, str] | None:
        return {"token": "s3cret"} if name == "sec" else None


def test_volumes_are_materialised(tmp_path: Path) -> None:
    from pdserve_dev.process_node.podenv import PodAddresses

    pod = {
        "metadata": {"name": "p", "namespace": "ns", "labels": {"b": "2", "a": "1"}},
        "spec": {
            "volumes": [
                {"name": "scratch", "emptyDir": {}},
                {"name": "config", "configMap": {"name": "cfg", "items": [{"key": "router.yaml", "path": "r.yaml"}]}},
                {"name": "secret", "secret": {"secretName": "sec", "defaultMode": 0o600}},
                {
                    "name": "info",
                    "downwardAPI": {
                        "items": [
                            {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
                            {"path": "ip", "fieldRef": {"fieldPath": "status.podIP"}},
                        ]
                    },
                },
                {
                    "name": "kube-api-access",
                    "projected": {
                        "sources": [
                            {"serviceAccountToken": {"path": "token"}},
                            {"configMap": {"name": "cfg", "items": [{"key": "other", "path": "ca.crt"}]}},
                        ]
                    },
                },
                {"name": "data", "persistentVolumeClaim": {"claimName": "x"}},
            ]
        },
    }
    warnings: list[str] = []
    addresses = PodAddresses("127.5.0.1", "127.0.0.1")
    folders = materialise(pod, tmp_path, _Objects(), addresses, warn=warnings.append).folders
    assert sorted(folders) == ["config", "info", "kube-api-access", "scratch", "secret"]
    assert (tmp_path / "config" / "r.yaml").read_text() == "port: 80\n"
    assert not (tmp_path / "config" / "other").exists()
    assert (tmp_path / "secret" / "token").read_text() == "s3cret"
    assert (tmp_path / "secret" / "token").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "info" / "labels").read_text() == 'a="1"\nb="2"'
    assert (tmp_path / "info" / "ip").read_text() == "127.5.0.1"
    assert (tmp_path / "kube-api-access" / "ca.crt").read_text() == "x"
    assert len(warnings) == 1 and "persistentVolumeClaim" in warnings[0]
