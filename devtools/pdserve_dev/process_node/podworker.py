"""One thread per pod: runs its containers, probes them, reports status, and tears it all down.

The worker is level-driven: every pass of its loop looks at the latest pod object it was handed and at its
processes, does whatever is due (start, restart after back-off, probe, stop), patches the status if it
changed, and sleeps until the next thing is due or something wakes it (a watch event, a process exit).
Init containers run one after the other to completion before the regular containers start.

A pod leaves the worker in one of three ways:

* it gets a deletionTimestamp: what the kubelet does (`_terminate`): per container the preStop hook, SIGTERM,
  SIGKILL when the grace period is up, readiness probed and the status reported all along (so a server that
  starts refusing turns the pod not ready, and its EndpointSlice entry `serving: false`), then the object is
  deleted with grace period 0 so it goes away;
* it vanishes from the API (force deletion): processes are stopped within 2 s;
* the process node shuts down: processes are stopped (grace capped by ``--shutdown-grace``), the pod object
  is left alone so a restarted process node picks it up again.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from pdserve_dev.process_node import launch
from pdserve_dev.process_node.backoff import CrashBackoff
from pdserve_dev.process_node.imagemap import ImageMap, LocalCommand, NotMappedError
from pdserve_dev.process_node.ipam import PodIPAllocator
from pdserve_dev.process_node.kube import ApiException, Kube
from pdserve_dev.process_node.lifecycle import grace_after_hook, run_hook
from pdserve_dev.process_node.podenv import (
    ContainerConfigError,
    PodAddresses,
    container_env,
    expand_command,
)
from pdserve_dev.process_node.podstatus import ContainerView, Terminated, pod_status
from pdserve_dev.process_node.probes import ProbeTracker, container_probes, run_probe, running
from pdserve_dev.process_node.process import LocalProcess, signal_group
from pdserve_dev.process_node.security import container_security
from pdserve_dev.process_node.tokens import ProjectedToken
from pdserve_dev.process_node.volumes import Mount, container_mounts, materialise, rewrite_path

log = logging.getLogger(__name__)

Obj = dict[str, Any]

# Longest a worker sleeps without a reason: bounds how stale a missed wake-up can make anything.
_MAX_SLEEP = 5.0
_CONFIG_RETRY = 2.0
_VANISHED_GRACE = 2.0


@dataclass
class NodeContext:
    """What every pod worker shares."""

    kube: Kube
    node_name: str
    workdir: Path
    image_map: ImageMap
    allocator: PodIPAllocator
    host_ip: str
    base_env: dict[str, str]
    allocatable: dict[str, str]
    shutdown_grace: float = 10.0
    backoff_initial: float = 10.0
    backoff_cap: float = 300.0
    sandbox: launch.SandboxSettings | None = None
    """Set when containers run in the sandbox (see launch); None: the fallback."""
    service_env: dict[str, str] = field(default_factory=dict)
    """The `kubernetes` Service variables every container gets (apiservice), set once the node has started."""

    def log_path(self, namespace: str, pod: str, container: str) -> Path:
        return self.workdir / "logs" / f"{namespace}_{pod}_{container}.log"

    def pid_path(self, namespace: str, pod: str, container: str) -> Path:
        return self.workdir / "pids" / f"{namespace}_{pod}_{container}.pid"


@dataclass
class Container:
    """One container's runtime state across its restarts."""

    spec: Obj
    init: bool
    backoff: CrashBackoff
    view: ContainerView
    process: LocalProcess | None = None
    probes: dict[str, ProbeTracker] = field(default_factory=dict)
    restart_at: float | None = None  # monotonic; set while in back-off
    retry_at: float | None = None  # monotonic; set after a configuration error
    attempts: int = 0
    finished: bool = False  # exited and will not be restarted
    progressed: bool = False  # a sidecar that has started once: the next init container may run

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    @property
    def sidecar(self) -> bool:
        """An init container with restartPolicy Always: started in order, then kept running like the rest."""
        return self.init and self.spec.get("restartPolicy") == "Always"

    @property
    def init_done(self) -> bool:
        """Whether the init sequence may move past this container."""
        return self.progressed if self.sidecar else self.succeeded

    @property
    def succeeded(self) -> bool:
        return self.finished and self.view.terminated is not None and self.view.terminated.exit_code == 0


def _parse_time(value: str | None) -> float | None:
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


class PodWorker(threading.Thread):
    """Runs one pod (identified by UID) until it is deleted, vanishes or the node stops."""

    def __init__(self, ctx: NodeContext, pod: Obj, on_done: Callable[[PodWorker], None]) -> None:
        meta = pod["metadata"]
        self.uid: str = meta["uid"]
        self.namespace: str = meta.get("namespace", "default")
        self.pod_name: str = meta["name"]
        super().__init__(name=f"pod-{self.namespace}/{self.pod_name}", daemon=True)
        self.ctx = ctx
        self._pod = pod
        self._on_done = on_done
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._vanished = False
        self._node_stopping = False
        self.pod_dir = ctx.workdir / "pods" / f"{self.namespace}_{self.pod_name}_{self.uid[:8]}"
        self.ip: str | None = None
        self._volumes: dict[str, Path] | None = None
        self._tokens: list[ProjectedToken] = []
        self._reported: set[str] = set()  # containers whose unemulated settings were reported
        self._last_status: Obj | None = None
        self._start_time = _parse_time(pod.get("status", {}).get("startTime")) or time.time()
        restarts = {
            s.get("name"): int(s.get("restartCount", 0))
            for key in ("initContainerStatuses", "containerStatuses")
            for s in pod.get("status", {}).get(key) or []
        }
        spec = pod.get("spec", {})
        self.init = [self._container(c, True, restarts) for c in spec.get("initContainers") or []]
        self.main = [self._container(c, False, restarts) for c in spec.get("containers") or []]

    def _container(self, spec: Obj, init: bool, restarts: dict[str | None, int]) -> Container:
        view = ContainerView(
            name=spec["name"],
            image=spec.get("image", ""),
            restart_count=restarts.get(spec["name"], 0),
            sidecar=init and spec.get("restartPolicy") == "Always",
        )
        if not init and self.init_pending_at_start():
            view.waiting = ("PodInitializing", "")
        backoff = CrashBackoff(self.ctx.backoff_initial, self.ctx.backoff_cap)
        return Container(spec=spec, init=init, backoff=backoff, view=view)

    def init_pending_at_start(self) -> bool:
        return bool(self._pod.get("spec", {}).get("initContainers"))

    # --- called from the watch thread -------------------------------------------------------------------
    def update(self, pod: Obj) -> None:
        with self._lock:
            self._pod = pod
        self._wake.set()

    def vanish(self) -> None:
        self._vanished = True
        self._wake.set()

    def stop_for_shutdown(self) -> None:
        self._node_stopping = True
        self._wake.set()

    @property
    def label(self) -> str:
        return f"{self.namespace}/{self.pod_name}"

    def _snapshot(self) -> Obj:
        with self._lock:
            return self._pod

    # --- the loop ---------------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._run()
        except Exception:
            log.exception("Pod worker failed pod=%s", self.label)
            self._stop_all(0.0)
        finally:
            self._on_done(self)

    def _run(self) -> None:
        pod = self._snapshot()
        if pod.get("spec", {}).get("hostNetwork"):
            self.ip = self.ctx.host_ip
        else:
            self.ip = self.ctx.allocator.allocate(self.uid, pod.get("status", {}).get("podIP"))
        self.pod_dir.mkdir(parents=True, exist_ok=True)
        log.info("Admitted pod pod=%s uid=%s ip=%s", self.label, self.uid, self.ip)
        while True:
            pod = self._snapshot()
            if self._vanished or self._node_stopping or pod["metadata"].get("deletionTimestamp"):
                break
            try:
                due = self._sync(pod)
            except Exception as exc:  # an API hiccup must not kill the pod's processes
                log.warning("Failed to sync pod pod=%s error=%s", self.label, exc)
                due = time.monotonic() + _CONFIG_RETRY
            self._wake.wait(min(max(due - time.monotonic(), 0.0), _MAX_SLEEP))
            self._wake.clear()
        self._teardown(self._snapshot())

    def _sync(self, pod: Obj) -> float:
        """Do what is due; return the monotonic time of the next thing that will be due."""
        now = time.monotonic()
        if self._volumes is None and not self._materialise(pod):
            self._report(pod)
            return now + _CONFIG_RETRY
        token_due = self._refresh_tokens(pod)
        for container in self.init:
            if not container.init_done or container.sidecar:
                self._step(pod, container)
                self._probe(pod, container)
            if container.sidecar and container.view.started:
                container.progressed = True
            if not container.init_done:
                break
        if all(c.init_done for c in self.init):
            for container in self.main:
                self._step(pod, container)
            for container in self.main:
                self._probe(pod, container)
        self._report(pod)
        return min([now + _MAX_SLEEP, token_due] + [t for c in self.init + self.main for t in self._due_times(c)])

    def _refresh_tokens(self, pod: Obj) -> float:
        """Write fresh service account tokens where due; return the monotonic time of the next refresh."""
        wall = time.time()
        for token in self._tokens:
            if token.due(wall):
                try:
                    token.refresh(self.ctx.kube, pod)
                    log.info("Refreshed service account token pod=%s file=%s", self.label, token.path)
                except Exception as exc:  # the old token stays valid for a while: retry soon
                    log.warning("Failed to refresh service account token pod=%s error=%s", self.label, exc)
                    token.refresh_at = wall + _CONFIG_RETRY
        next_refresh = min((t.refresh_at for t in self._tokens), default=wall + _MAX_SLEEP)
        return time.monotonic() + max(next_refresh - wall, 0.0)

    @staticmethod
    def _due_times(container: Container) -> list[float]:
        times = [t for t in (container.restart_at, container.retry_at) if t is not None]
        if container.process is not None:
            times.extend(tracker.next_due for tracker in running(container.probes))
        return times

    def _materialise(self, pod: Obj) -> bool:
        try:
            volumes = materialise(
                pod,
                self.pod_dir / "volumes",
                self.ctx.kube,
                self._addresses(),
                warn=lambda m: log.warning("%s pod=%s", m, self.label),
                tokens=self.ctx.kube if self.ctx.sandbox is not None else None,
            )
            self._volumes, self._tokens = volumes.folders, volumes.tokens
            return True
        except (ContainerConfigError, ApiException, OSError) as exc:
            message = str(exc) if not isinstance(exc, ApiException) else f"API error: {exc.status} {exc.reason}"
            waiting = ("CreateContainerConfigError", message)
            if any(c.view.waiting != waiting for c in self.init + self.main):  # log each problem once
                log.warning("Failed to materialise volumes pod=%s error=%s", self.label, message)
            for container in self.init + self.main:
                container.view.waiting = waiting
            return False

    def _addresses(self) -> PodAddresses:
        return PodAddresses(pod_ip=self.ip or "", host_ip=self.ctx.host_ip)

    # --- one container ----------------------------------------------------------------------------------
    def _step(self, pod: Obj, container: Container) -> None:
        """Notice an exit, or (re)start the container when it is due."""
        if container.process is not None:
            code = container.process.poll()
            if code is None:
                return
            self._exited(pod, container, container.process, code)
        if container.finished:
            return
        now = time.monotonic()
        if container.restart_at is not None and now < container.restart_at:
            return
        if container.retry_at is not None and now < container.retry_at:
            return
        self._start(pod, container)

    def _start(self, pod: Obj, container: Container) -> None:
        view = container.view
        try:
            argv, env, cwd = self._prepare(pod, container)
        except (ContainerConfigError, NotMappedError, ApiException, FileNotFoundError) as exc:
            if isinstance(exc, FileNotFoundError):
                # Like a runtime failing to exec the entrypoint: a StartError termination, then back-off.
                self._start_error(pod, container, exc)
                return
            before = view.waiting
            retry = _CONFIG_RETRY
            if isinstance(exc, NotMappedError):
                # The image map does not change while the node runs: retry every 30 s only.
                view.waiting = (exc.reason, exc.message)
                retry = _MAX_SLEEP * 6
            elif isinstance(exc, ApiException):
                view.waiting = ("CreateContainerConfigError", f"API error: {exc.status} {exc.reason}")
            else:
                view.waiting = ("CreateContainerConfigError", str(exc))
            container.retry_at = time.monotonic() + retry
            if view.waiting != before:  # log each distinct problem once, not every retry
                log.warning(
                    "Failed to prepare container pod=%s container=%s reason=%s message=%s",
                    self.label,
                    container.name,
                    view.waiting[0],
                    view.waiting[1],
                )
                self._event(pod, "Warning", "Failed", f"Error: {view.waiting[0]}: {view.waiting[1]}", container.name)
            return
        container.retry_at = None
        container.restart_at = None
        if container.attempts > 0:
            view.restart_count += 1
        container.attempts += 1
        view.command = argv
        try:
            process = LocalProcess.start(
                argv,
                env=env,
                cwd=cwd,
                log_path=self.ctx.log_path(self.namespace, self.pod_name, container.name),
                pid_path=self.ctx.pid_path(self.namespace, self.pod_name, container.name),
                on_exit=self._wake.set,
            )
        except OSError as exc:
            self._start_error(pod, container, exc)
            return
        container.process = process
        probes = container_probes(container.spec)
        started_mono = time.monotonic()
        container.probes = {kind: ProbeTracker(spec, started_mono) for kind, spec in probes.items()}
        view.running_since = process.started_at
        view.waiting = None
        view.terminated = None
        view.pid = process.pid
        # No startup probe: started at once; no readiness probe: ready as soon as started.
        view.started = "startup" not in probes
        view.ready = view.started and "readiness" not in probes and (container.sidecar or not container.init)
        log.info(
            "Started container pod=%s container=%s pid=%s restarts=%s argv=%s",
            self.label,
            container.name,
            process.pid,
            view.restart_count,
            argv,
        )
        self._event(pod, "Normal", "Started", f"Started container {container.name} (pid {process.pid})", container.name)

    def _start_error(self, pod: Obj, container: Container, exc: OSError) -> None:
        """Like a runtime failing to exec the entrypoint: a StartError termination, then back-off."""
        log.warning("Failed to start container pod=%s container=%s error=%s", self.label, container.name, exc)
        self._event(pod, "Warning", "Failed", f"Error: failed to start container: {exc}", container.name)
        now = time.time()
        self._record_exit(pod, container, Terminated(128, "StartError", None, now, str(exc)), ran_for=0.0)

    def _prepare(self, pod: Obj, container: Container) -> tuple[list[str], dict[str, str], Path]:
        """Resolve the container's argv, environment and working folder."""
        spec = container.spec
        spec_env = container_env(pod, spec, self._addresses(), self.ctx.kube, self.ctx.allocatable)
        command, args = expand_command(spec, spec_env)
        local = self.ctx.image_map.resolve(spec.get("image", ""), command, args)
        if self.ctx.sandbox is None:
            return self._prepare_unsandboxed(pod, spec, spec_env, local)
        security = container_security(pod, spec, local.user)
        if security.not_emulated and container.name not in self._reported:
            self._reported.add(container.name)
            message = f"Not emulated by the process node: {', '.join(security.not_emulated)}"
            log.info("%s pod=%s container=%s", message, self.label, container.name)
            self._event(pod, "Normal", "SecurityContextNotEmulated", message, container.name)
        env = dict(self.ctx.base_env)
        hostname = pod.get("spec", {}).get("hostname") or self.pod_name
        env["HOSTNAME"] = hostname
        if security.uid != 0:
            env["HOME"] = "/"  # what runtimes set for a user the image's /etc/passwd does not know
        env.update(local.image_env)
        env.update(self.ctx.service_env)
        env["PDSERVE_BIND_HOST"] = self.ip or self.ctx.host_ip
        env.update(spec_env)
        _check_executable(local.argv[0], env.get("PATH", ""))
        volumes = self._volumes or {}
        mounts = []
        for mount in spec.get("volumeMounts") or []:
            folder = volumes.get(mount.get("name", ""))
            if folder is None:
                continue  # an unsupported volume (already warned about): the host's folder shows through
            source = folder / mount["subPath"] if mount.get("subPath") else folder
            read_only = bool(mount.get("readOnly"))
            mounts.append({"source": str(source), "target": mount["mountPath"], "readOnly": read_only})
        spec_path = self.pod_dir / "sandbox" / f"{container.name}.json"
        root = self.pod_dir / "rootfs" / container.name
        root.mkdir(parents=True, exist_ok=True)
        launch.write_spec(
            spec_path,
            root=root,
            mounts=mounts,
            security=security,
            working_dir=spec.get("workingDir") or "/",
            hostname=hostname,
            reachable=self.ctx.sandbox.reachable,
        )
        return self.ctx.sandbox.command(spec_path, local.argv), env, self.pod_dir

    def _prepare_unsandboxed(
        self, pod: Obj, spec: Obj, spec_env: dict[str, str], local: LocalCommand
    ) -> tuple[list[str], dict[str, str], Path]:
        """The fallback: the host's file system, volume paths rewritten, the node's kubeconfig."""
        mounts: list[Mount] = container_mounts(spec, self._volumes or {})
        argv = [rewrite_path(word, mounts) for word in local.argv]
        env = dict(self.ctx.base_env)
        env["HOSTNAME"] = pod.get("spec", {}).get("hostname") or self.pod_name
        env.update(local.image_env)
        env["PDSERVE_BIND_HOST"] = self.ip or self.ctx.host_ip
        env.update({key: rewrite_path(value, mounts) for key, value in spec_env.items()})
        cwd = self.pod_dir
        working_dir = spec.get("workingDir")
        if working_dir:
            rewritten = Path(rewrite_path(working_dir, mounts))
            if rewritten.is_dir():
                cwd = rewritten
        return argv, env, cwd

    def _exited(self, pod: Obj, container: Container, process: LocalProcess, code: int) -> None:
        reason = "Completed" if code == 0 else "Error"
        finished = process.finished_at or time.time()
        terminated = Terminated(code, reason, process.started_at, finished)
        log.info(
            "Container exited pod=%s container=%s pid=%s exitCode=%s", self.label, container.name, process.pid, code
        )
        self._record_exit(pod, container, terminated, process.ran_for)

    def _record_exit(self, pod: Obj, container: Container, terminated: Terminated, ran_for: float) -> None:
        """Decide, per restartPolicy, whether the container restarts (after back-off) or stays terminated."""
        view = container.view
        container.process = None
        container.probes = {}
        view.running_since = None
        view.pid = None
        view.ready = False
        view.started = False
        policy = pod.get("spec", {}).get("restartPolicy", "Always")
        failed = terminated.exit_code != 0
        if container.sidecar:
            restart = True
        elif container.init:
            restart = failed and policy != "Never"
        else:
            restart = policy == "Always" or (policy == "OnFailure" and failed)
        if not restart:
            view.terminated = terminated
            view.waiting = None
            container.finished = True
            return
        view.last_terminated = terminated
        view.terminated = None
        delay = container.backoff.next_delay(ran_for)
        container.restart_at = time.monotonic() + delay
        if delay > 0:
            view.waiting = (
                "CrashLoopBackOff",
                f"back-off {delay:.0f}s restarting failed container={container.name} pod={self.pod_name}",
            )
            log.info("Backing off container restart pod=%s container=%s delay=%.0fs", self.label, container.name, delay)
            self._event(pod, "Warning", "BackOff", f"Back-off {delay:.0f}s restarting failed container", container.name)
        else:
            view.waiting = ("ContainerCreating", "")

    def _probe(self, pod: Obj, container: Container) -> None:
        """Run the container's due probes and act on their results."""
        process = container.process
        if process is None or not container.probes or self.ip is None:
            return
        view = container.view
        startup = container.probes.get("startup")
        if startup is not None and not startup.success:
            if startup.is_due(time.monotonic()):
                ok, why = run_probe(startup.spec, container.spec, self.ip)
                startup.record(ok, time.monotonic())
                if startup.success:
                    view.started = True
                    view.ready = "readiness" not in container.probes
                elif startup.failing:
                    self._kill_unhealthy(pod, container, f"Startup probe failed: {why}")
            return
        self._probe_readiness(pod, container)
        liveness = container.probes.get("liveness")
        if liveness is not None and liveness.is_due(time.monotonic()):
            ok, why = run_probe(liveness.spec, container.spec, self.ip)
            liveness.record(ok, time.monotonic())
            if not liveness.success:
                self._kill_unhealthy(pod, container, f"Liveness probe failed: {why}")

    def _probe_readiness(self, pod: Obj, container: Container) -> None:
        """Run the readiness probe if due (also while the pod terminates, as the kubelet does)."""
        readiness = container.probes.get("readiness")
        if readiness is None or self.ip is None or not readiness.is_due(time.monotonic()):
            return
        ok, why = run_probe(readiness.spec, container.spec, self.ip)
        if readiness.record(ok, time.monotonic()):
            log.info(
                "Readiness changed pod=%s container=%s ready=%s %s", self.label, container.name, readiness.success, why
            )
            if not readiness.success:
                self._event(pod, "Warning", "Unhealthy", f"Readiness probe failed: {why}", container.name)
        container.view.ready = readiness.success

    def _kill_unhealthy(self, pod: Obj, container: Container, why: str) -> None:
        process = container.process
        if process is None:
            return
        log.info(
            "Killing unhealthy container pod=%s container=%s pid=%s: %s", self.label, container.name, process.pid, why
        )
        self._event(pod, "Warning", "Unhealthy", why, container.name)
        self._event(
            pod, "Normal", "Killing", f"Container {container.name} failed its probe, will be restarted", container.name
        )
        code = process.stop(self._grace(pod))
        terminated = Terminated(code, "Error", process.started_at, process.finished_at or time.time(), why)
        self._record_exit(pod, container, terminated, process.ran_for)

    def _event(self, pod: Obj, kind: str, reason: str, message: str, container: str = "") -> None:
        """Post an Event for `kubectl describe`; an Event that fails to post is only logged."""
        try:
            self.ctx.kube.record_event(
                pod, kind=kind, reason=reason, message=message, container=container, node=self.ctx.node_name
            )
        except Exception as exc:
            log.debug("Failed to post event pod=%s reason=%s error=%s", self.label, reason, exc)

    # --- status -----------------------------------------------------------------------------------------
    def _report(self, pod: Obj) -> None:
        status = pod_status(
            pod,
            pod_ip=self.ip,
            host_ip=self.ctx.host_ip,
            start_time=self._start_time,
            init=[c.view for c in self.init],
            main=[c.view for c in self.main],
            now=time.time(),
            previous_conditions=(self._last_status or {}).get("conditions"),
        )
        if status == self._last_status and _still_reported(pod.get("status") or {}, status):
            return
        self.ctx.kube.patch_pod_status(self.namespace, self.pod_name, status, uid=self.uid)
        if (self._last_status or {}).get("phase") != status["phase"]:
            log.info("Pod phase changed pod=%s phase=%s ip=%s", self.label, status["phase"], self.ip)
        self._last_status = status

    # --- teardown ---------------------------------------------------------------------------------------
    def _grace(self, pod: Obj) -> float:
        meta, spec = pod.get("metadata", {}), pod.get("spec", {})
        grace = meta.get("deletionGracePeriodSeconds")
        if grace is None:
            grace = spec.get("terminationGracePeriodSeconds", 30)
        return float(grace)

    def _stop_all(self, grace: float) -> None:
        """SIGTERM every container at once, then give them one shared grace period."""
        running = [c for c in self.init + self.main if c.process is not None]
        for container in running:
            assert container.process is not None
            signal_group(container.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for container in running:
            process = container.process
            assert process is not None
            code = process.stop(max(deadline - time.monotonic(), 0.0))
            log.info(
                "Stopped container pod=%s container=%s pid=%s exitCode=%s",
                self.label,
                container.name,
                process.pid,
                code,
            )
            container.view.terminated = Terminated(
                code, "Completed" if code == 0 else "Error", process.started_at, process.finished_at or time.time()
            )
            container.view.running_since = None
            container.process = None

    def _terminate(self, pod: Obj, grace: float) -> None:
        """Stop a deleted pod's containers as the kubelet does (`lifecycle`): each one in parallel runs its preStop
        hook within the grace period, then gets SIGTERM with what is left of it (at least 2 s), then SIGKILL.

        Meanwhile the worker keeps probing readiness (the kubelet stops only liveness and startup probes of a pod
        being deleted) and reporting the status, so a server that starts refusing while it drains turns the pod not
        ready, and containers show as terminated as they exit.
        """
        running = [c for c in self.init + self.main if c.process is not None]
        codes: dict[str, int] = {}

        def stop(container: Container, process: LocalProcess) -> None:
            left = grace
            hook = (container.spec.get("lifecycle") or {}).get("preStop")
            if hook and grace > 0:
                started = time.monotonic()
                try:
                    _, env, cwd = self._prepare(pod, container)
                except (ContainerConfigError, NotMappedError, ApiException):
                    env, cwd = dict(self.ctx.base_env), self.pod_dir
                ok, why = run_hook(
                    hook, container=container.spec, pod_ip=self.ip or "", env=env, cwd=cwd, timeout=grace
                )
                if not ok:
                    log.warning("PreStop hook failed pod=%s container=%s: %s", self.label, container.name, why)
                    self._event(pod, "Warning", "FailedPreStopHook", f"PreStopHook failed: {why}", container.name)
                left = grace_after_hook(grace, time.monotonic() - started)
            codes[container.name] = process.stop(left)
            self._wake.set()

        stoppers = []
        for container in running:
            assert container.process is not None
            thread = threading.Thread(
                target=stop, args=(container, container.process), name=f"stop-{self.pod_name}-{container.name}"
            )
            thread.start()
            stoppers.append(thread)
        while any(thread.is_alive() for thread in stoppers):
            for container in self.main:
                if container.name not in codes:
                    self._probe_readiness(pod, container)
            with contextlib.suppress(Exception):  # the API may be down; the kubelet reports again later too
                self._report(pod)
            due = [t.next_due for c in self.main for t in c.probes.values() if t.spec.kind == "readiness"]
            self._wake.wait(max(0.0, min([time.monotonic() + 1.0, *due]) - time.monotonic()))
            self._wake.clear()
        for container in running:
            process = container.process
            assert process is not None
            code = codes.get(container.name, 137)
            name, pid = container.name, process.pid
            log.info("Stopped container pod=%s container=%s pid=%s exitCode=%s", self.label, name, pid, code)
            container.view.terminated = Terminated(
                code, "Completed" if code == 0 else "Error", process.started_at, process.finished_at or time.time()
            )
            container.view.running_since = None
            container.view.ready = False
            container.process = None
        with contextlib.suppress(Exception):
            self._report(pod)

    def _teardown(self, pod: Obj) -> None:
        deleting = bool(pod["metadata"].get("deletionTimestamp")) and not self._vanished
        grace = self._grace(pod)
        if self._vanished:
            grace = min(grace, _VANISHED_GRACE)
        elif self._node_stopping and not deleting:
            grace = min(grace, self.ctx.shutdown_grace)
        if deleting:
            for container in self.init + self.main:
                if container.process is not None:
                    self._event(pod, "Normal", "Killing", f"Stopping container {container.name}", container.name)
            self._terminate(pod, grace)
        else:
            self._stop_all(grace)
        if self._node_stopping and not deleting:
            log.info("Stopped pod for node shutdown pod=%s", self.label)
            return
        if deleting:
            try:
                self.ctx.kube.delete_pod_now(self.namespace, self.pod_name, self.uid)
                log.info("Deleted pod pod=%s uid=%s", self.label, self.uid)
            except Exception as exc:  # the watch re-delivers the pod; a later worker retries
                log.warning("Failed to delete pod pod=%s error=%s", self.label, exc)
        self.ctx.allocator.release(self.uid)
        shutil.rmtree(self.pod_dir, ignore_errors=True)


def _check_executable(program: str, path: str) -> None:
    """FileNotFoundError when `program` cannot be found (what exec would say, reported as StartError)."""
    if os.sep in program:
        found = os.path.isfile(program) and os.access(program, os.X_OK)
    else:
        found = shutil.which(program, path=path) is not None
    if not found:
        raise FileNotFoundError(errno.ENOENT, f"exec: {program!r}: executable file not found in $PATH")


def host_environment(kubeconfig: str, *, sandbox: bool) -> dict[str, str]:
    """The base environment of every container: the process node's own, with its Python first on PATH.

    Containers have no image filesystem, so they need the host's PATH, locale and the like; putting the
    interpreter's folder first lets ``pdserve`` or ``python3`` in passthrough commands find this install.
    With the sandbox, containers find the API the in-cluster way (their ServiceAccount's token at the standard
    path and the ``kubernetes`` Service variables), so no client configuration of the node's leaks into them.
    Without it there is no token mount, so ``KUBECONFIG`` names the cluster's kubeconfig instead.
    """
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG" and not k.startswith("KUBERNETES_")}
    if not sandbox:
        env["KUBECONFIG"] = os.path.abspath(kubeconfig)
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(dict.fromkeys([venv_bin, *env.get("PATH", "").split(os.pathsep)]))
    return env


def _still_reported(api: Obj, ours: Obj) -> bool:
    """Whether the pod's status in the API (the watch's latest copy) still says what the worker last reported:
    its phase, its address and each condition it reports.

    Another writer may have changed it since: the node lifecycle controller marks every pod of a node Ready=False
    when the node's heartbeat went stale (a control-plane outage longer than its grace period is enough). The
    kubelet's status manager reconciles such a difference by reporting again; so does the worker, or the pods
    stay unready behind their Services for good once the node is back (found by the chaos benchmark's
    kube-apiserver restart)."""
    if api.get("phase") != ours.get("phase") or api.get("podIP") != ours.get("podIP"):
        return False
    theirs = {condition.get("type"): condition.get("status") for condition in api.get("conditions") or []}
    return all(theirs.get(condition["type"]) == condition["status"] for condition in ours.get("conditions") or [])
