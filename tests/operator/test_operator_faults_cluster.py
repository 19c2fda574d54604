"""The operator's status when an engine crashes, on the local cluster's process node (issue 13, item 8).

The engines are real processes (the vLLM image runs the engine simulator) and the process node restarts an exited
container as a kubelet does: at once after its first exit. So an engine that crashes once never reaches
CrashLoopBackOff, and an operator that waits for it reports nothing. The operator here resyncs only every 10
minutes: whatever it reports within this test came from the pod's watch event (and, for the recovery, from the
re-run it asked for when the recovery window ends), not from a periodic pass.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve_dev.testing.cluster import ClusterHelper
from pdserve_dev.testing.operator import OperatorProcess
from pdserve_dev.testing.wait import wait_for
from pdserve_operator.status import parse_time

ROOT = Path(__file__).resolve().parents[2]
NAME = "crash"
WINDOW = 5  # --crash-recovery-seconds
RESYNC = 600  # longer than the test: no pass comes from the resync timer
pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture(scope="module")
def namespace(cluster: ClusterHelper) -> Iterator[str]:
    if cluster.process_node_workdir is None:
        pytest.skip("the local cluster runs without its process node")
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds" / "pdservice.yaml"))
    cluster.wait_crd_established()
    name = cluster.create_namespace("faults")
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def operator(
    cluster: ClusterHelper, namespace: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    log = tmp_path_factory.mktemp("faults") / "operator.log"
    extra = ["--resync-seconds", str(RESYNC), "--relist-seconds", str(RESYNC), "--crash-recovery-seconds", str(WINDOW)]
    with OperatorProcess(
        cluster.kubeconfig, log, namespaces=[namespace], identity="faults", lease_namespace=namespace, extra=extra
    ) as process:
        process.wait_ready()
        yield process


@pytest.fixture(scope="module")
def serving(cluster: ClusterHelper, namespace: str, operator: OperatorProcess) -> str:
    """examples/local-sim.yaml with one engine per pool, Ready (kstatus: up to date, nothing degraded)."""
    document = yaml.safe_load((ROOT / "examples" / "local-sim.yaml").read_text())
    document["metadata"] = {"name": NAME, "namespace": namespace}
    document["spec"]["decode"]["replicas"] = 1
    cluster.apply(json.dumps(document))
    result = cluster.kubectl(
        "wait", "--for=condition=Ready", f"pds/{NAME}", "-n", namespace, "--timeout=180s", check=False, timeout=200
    )
    if result.returncode != 0:
        status = cluster.kubectl("get", f"pds/{NAME}", "-n", namespace, "-o", "yaml", check=False).stdout
        pytest.fail(f"{NAME} never became Ready\n{status}\n{operator.log_tail()}")
    return NAME


def conditions(cluster: ClusterHelper, namespace: str) -> dict[str, dict[str, Any]]:
    status = cluster.get_json(f"pds/{NAME}", "-n", namespace).get("status") or {}
    return {c["type"]: c for c in status.get("conditions") or []}


def events(cluster: ClusterHelper, namespace: str, reason: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = cluster.get_json(
        "events", "-n", namespace, f"--field-selector=involvedObject.name={NAME},reason={reason}"
    ).get("items", [])
    return found


def seconds(later: str, earlier: str) -> float:
    end, start = parse_time(later), parse_time(earlier)
    assert end is not None and start is not None, (later, earlier)
    return (end - start).total_seconds()


def test_a_single_engine_crash_is_degraded_at_once_and_recovers_after_the_window(
    cluster: ClusterHelper, namespace: str, operator: OperatorProcess, serving: str, record_property: Any
) -> None:
    pod = f"{NAME}-decode-0"
    before = cluster.get_json("pod", pod, "-n", namespace)
    assert before["status"]["containerStatuses"][0]["restartCount"] == 0
    assert conditions(cluster, namespace)["Degraded"]["status"] == "False"
    recovered_before = len(events(cluster, namespace, "Recovered"))  # e.g. pods briefly pending at creation

    # The simulator exits with status 70 right after answering (its fault injection); the process node restarts
    # it at once, as a kubelet does after a first exit.
    request = urllib.request.Request(
        f"http://{before['status']['podIP']}:8000/sim/faults",
        data=json.dumps({"crash": True}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200

    # The counted event: the operator's status write. With no resync within the test, only the pod's watch event
    # can have triggered the pass that wrote it.
    degraded = wait_for(
        lambda: (found := conditions(cluster, namespace).get("Degraded", {})).get("status") == "True" and found,
        timeout=60,
        message=lambda: f"Degraded=True after the crash; log:\n{operator.log_tail(30)}",
    )
    crashed = cluster.get_json("pod", pod, "-n", namespace)["status"]["containerStatuses"][0]
    terminated = crashed["lastState"]["terminated"]
    assert degraded["reason"] == "EngineCrashed"
    assert degraded["message"] == (
        f"{pod}/vllm: exited with code 70 ({terminated['reason']}) at {terminated['finishedAt']}, 1 restart"
    )
    assert crashed["restartCount"] == 1
    latency = seconds(degraded["lastTransitionTime"], terminated["finishedAt"])
    record_property("crash_to_degraded_seconds", latency)
    print(f"crash -> Degraded=True: {latency:.0f} s (one-second timestamps; resync every {RESYNC} s)")
    assert 0 <= latency < RESYNC
    # kstatus: a single crash is in progress (the kubelet is restarting it), not stalled.
    now = conditions(cluster, namespace)
    assert (now["Stalled"]["status"], now["Reconciling"]["status"]) == ("False", "True")
    assert now["Ready"]["status"] == "False"
    warning = events(cluster, namespace, "EngineCrashed")
    assert [(e["type"], e["message"]) for e in warning] == [("Warning", degraded["message"])]

    # Recovery: the engine is running and ready again, and has been for the window. The pass that clears the
    # condition comes from the operator's own re-run at the end of the window.
    recovered = wait_for(
        lambda: (found := conditions(cluster, namespace).get("Degraded", {})).get("status") == "False" and found,
        timeout=120,
        message=lambda: f"Degraded=False after the restart; log:\n{operator.log_tail(30)}",
    )
    after = cluster.get_json("pod", pod, "-n", namespace)
    ready = next(c for c in after["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True"
    assert after["status"]["containerStatuses"][0]["restartCount"] == 1  # the same incarnation, not a second crash
    assert seconds(recovered["lastTransitionTime"], ready["lastTransitionTime"]) >= WINDOW  # never before the window
    assert len(events(cluster, namespace, "Recovered")) == recovered_before + 1
    assert len(events(cluster, namespace, "EngineCrashed")) == 1  # one crash, one warning
    assert conditions(cluster, namespace)["Stalled"]["status"] == "False"
