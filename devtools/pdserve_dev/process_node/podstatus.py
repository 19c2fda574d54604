"""The pod status a kubelet would report, computed from what the process node knows (pure).

Phase, following the kubelet's rules:

* an init container that has not completed -> Pending (Failed if it failed and restartPolicy is Never);
* a regular container waiting without ever having run -> Pending;
* else any container running -> Running;
* else (all stopped): Always -> Running (they are restarting); OnFailure -> Succeeded when all exited 0,
  else Running; Never -> Failed when any exited non-zero, else Succeeded.

Conditions: PodScheduled, PodReadyToStartContainers (the pod IP exists), Initialized, ContainersReady and
Ready (ContainersReady plus every readiness gate). A condition's lastTransitionTime is kept from the pod's
current status unless its status flips.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

Obj = dict[str, Any]


def rfc3339(timestamp: float) -> str:
    """Kubernetes' metav1.Time format (seconds precision, UTC)."""
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Terminated:
    """How a container run ended."""

    exit_code: int
    reason: str
    started_at: float | None
    finished_at: float
    message: str = ""

    def to_k8s(self, container_id: str = "") -> Obj:
        state: Obj = {"exitCode": self.exit_code, "reason": self.reason, "finishedAt": rfc3339(self.finished_at)}
        if self.started_at is not None:
            state["startedAt"] = rfc3339(self.started_at)
        if self.message:
            state["message"] = self.message
        if container_id:
            state["containerID"] = container_id
        return {"terminated": state}


@dataclass
class ContainerView:
    """One container as the status reports it; exactly one of running/waiting/terminated applies."""

    name: str
    image: str
    running_since: float | None = None
    waiting: tuple[str, str] | None = ("ContainerCreating", "")
    terminated: Terminated | None = None
    last_terminated: Terminated | None = None
    restart_count: int = 0
    ready: bool = False
    started: bool = False
    pid: int | None = None
    command: list[str] = field(default_factory=list)
    sidecar: bool = False  # an init container with restartPolicy Always

    def state(self) -> Obj:
        if self.running_since is not None:
            return {"running": {"startedAt": rfc3339(self.running_since)}}
        if self.terminated is not None:
            return self.terminated.to_k8s()
        reason, message = self.waiting or ("ContainerCreating", "")
        waiting: Obj = {"reason": reason}
        if message:
            waiting["message"] = message
        return {"waiting": waiting}

    def to_k8s(self) -> Obj:
        status: Obj = {
            "name": self.name,
            "image": self.image,
            # No image is pulled; the ID names the local program so `kubectl describe` shows what ran.
            "imageID": f"process-node://{self.command[0]}" if self.command else "",
            "ready": self.ready,
            "started": self.started,
            "restartCount": self.restart_count,
            "state": self.state(),
            "lastState": self.last_terminated.to_k8s() if self.last_terminated else {},
        }
        if self.pid is not None:
            status["containerID"] = f"process://{self.pid}"
        return status


def pod_phase(restart_policy: str, init: list[ContainerView], main: list[ContainerView]) -> str:
    """The pod phase from its containers' states (see the module docstring)."""
    for view in init:
        if view.sidecar or (view.terminated is not None and view.terminated.exit_code == 0):
            continue
        init_failed = view.terminated is not None or view.last_terminated is not None
        return "Failed" if init_failed and restart_policy == "Never" and view.running_since is None else "Pending"
    running = stopped = succeeded = failed = waiting = 0
    for view in main:
        if view.running_since is not None:
            running += 1
            continue
        ended = view.terminated or view.last_terminated
        if ended is None:
            waiting += 1
            continue
        stopped += 1
        if ended.exit_code == 0:
            succeeded += 1
        else:
            failed += 1
    if waiting:
        return "Pending"
    if running:
        return "Running"
    if restart_policy == "Always":
        return "Running"
    if restart_policy == "OnFailure":
        return "Succeeded" if stopped == succeeded else "Running"
    return "Failed" if failed else "Succeeded"


def _init_complete(view: ContainerView) -> bool:
    """A regular init container exited 0; a sidecar has started (once is enough)."""
    if view.sidecar:
        return view.started or view.restart_count > 0
    return view.terminated is not None and view.terminated.exit_code == 0


def _condition(kind: str, ok: bool, reason: str = "", message: str = "") -> Obj:
    condition: Obj = {"type": kind, "status": "True" if ok else "False"}
    if not ok and reason:
        condition["reason"] = reason
        if message:
            condition["message"] = message
    return condition


def pod_conditions(
    pod: Obj,
    *,
    phase: str,
    network_ready: bool,
    init: list[ContainerView],
    main: list[ContainerView],
    now: float,
    previous: list[Obj] | None = None,
) -> list[Obj]:
    """The five kubelet conditions.

    Transition times are kept from ``previous`` (the conditions last reported, which the pod object may not
    show yet) or else from the pod's current status. Readiness gates are read from the pod's status, where
    other controllers set them.
    """
    gates = [gate["conditionType"] for gate in pod.get("spec", {}).get("readinessGates") or []]
    current = {c.get("type"): c for c in pod.get("status", {}).get("conditions") or []}
    reported = {c.get("type"): c for c in previous or []}
    pending_init = [v.name for v in init if not _init_complete(v)]
    # Sidecars count toward readiness like regular containers.
    unready = [v.name for v in init if v.sidecar and not v.ready] + [v.name for v in main if not v.ready]
    completed = phase in ("Succeeded", "Failed")
    unready_message = f"containers with unready status: [{' '.join(unready)}]"
    containers_ready = _condition(
        "ContainersReady", not unready and not completed, "ContainersNotReady", unready_message
    )
    if completed:
        containers_ready = _condition("ContainersReady", False, "PodCompleted")
    gates_missing = [g for g in gates if current.get(g, {}).get("status") != "True"]
    if containers_ready["status"] != "True":
        ready = {**containers_ready, "type": "Ready"}
    elif gates_missing:
        ready = _condition(
            "Ready",
            False,
            "ReadinessGatesNotReady",
            f"corresponding condition of pod readiness gate {gates_missing[0]!r} does not exist or is not True",
        )
    else:
        ready = _condition("Ready", True)
    conditions = [
        _condition("PodReadyToStartContainers", network_ready),
        _condition(
            "Initialized",
            not pending_init,
            "ContainersNotInitialized",
            f"containers with incomplete status: [{' '.join(pending_init)}]",
        ),
        ready,
        containers_ready,
        _condition("PodScheduled", True),
    ]
    for condition in conditions:
        before = reported.get(condition["type"]) or current.get(condition["type"])
        same = before is not None and before.get("status") == condition["status"]
        condition["lastTransitionTime"] = (before.get("lastTransitionTime") if same and before else None) or rfc3339(
            now
        )
    return conditions


def pod_status(
    pod: Obj,
    *,
    pod_ip: str | None,
    host_ip: str,
    start_time: float,
    init: list[ContainerView],
    main: list[ContainerView],
    now: float,
    previous_conditions: list[Obj] | None = None,
    message: str = "",
) -> Obj:
    """The full ``status`` to patch onto the pod."""
    restart_policy = pod.get("spec", {}).get("restartPolicy", "Always")
    phase = pod_phase(restart_policy, init, main)
    status: Obj = {
        "phase": phase,
        "hostIP": host_ip,
        "hostIPs": [{"ip": host_ip}],
        "startTime": rfc3339(start_time),
        "conditions": pod_conditions(
            pod,
            phase=phase,
            network_ready=pod_ip is not None,
            init=init,
            main=main,
            now=now,
            previous=previous_conditions,
        ),
        "containerStatuses": [view.to_k8s() for view in main],
    }
    if init:
        status["initContainerStatuses"] = [view.to_k8s() for view in init]
    if pod_ip is not None:
        status["podIP"] = pod_ip
        status["podIPs"] = [{"ip": pod_ip}]
    if message:
        status["message"] = message
    return status
