"""The process node's main loop: register the Node, watch its pods, hand each pod to a worker.

The pod watch is a real list+watch: list the pods bound to the node, hand every one to its worker, then
watch from the list's resourceVersion (with bookmarks, so the version stays fresh). A watch that ends is
resumed from the last version seen; "410 Gone" (the version was compacted away) means list again; any other
failure is retried with exponential back-off up to 30 s. A relist also tells workers whose pod is no longer
listed that it vanished.

Workers are keyed by pod UID, not name: a StatefulSet pod recreated under the same name is a new pod.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from pdserve_dev.process_node import apiservice
from pdserve_dev.process_node.kube import ApiException
from pdserve_dev.process_node.node import Heartbeat, register
from pdserve_dev.process_node.podworker import NodeContext, PodWorker
from pdserve_dev.process_node.process import kill_stale

log = logging.getLogger(__name__)

Obj = dict[str, Any]

WATCH_SECONDS = 240
MAX_BACKOFF = 30.0


class _GoneError(Exception):
    """The watch's resourceVersion is too old: list again."""


class ProcessNode:
    """Runs until :meth:`stop` is called (the CLI calls it on SIGTERM/SIGINT)."""

    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx
        self.stopping = threading.Event()
        self._workers: dict[str, PodWorker] = {}
        self._lock = threading.Lock()
        self._relay: apiservice.ServiceRelay | None = None

    def stop(self) -> None:
        self.stopping.set()

    def run(self) -> None:
        for sub in ("pids", "logs", "pods"):
            (self.ctx.workdir / sub).mkdir(parents=True, exist_ok=True)
        # Processes of a previous process node that died without stopping them: they are restarted fresh.
        for pid_file in sorted((self.ctx.workdir / "pids").glob("*.pid")):
            kill_stale(pid_file)
        node = self._register()
        if node is None:
            return
        if self.ctx.sandbox is not None:
            self._serve_kubernetes_service()
        Heartbeat(self.ctx.kube, self.ctx.node_name, node.get("metadata", {}).get("uid"), self.stopping).start()
        threading.Thread(target=self._watch_forever, name="pod-watch", daemon=True).start()
        log.info(
            "Process node ready node=%s workdir=%s podCIDR=%s",
            self.ctx.node_name,
            self.ctx.workdir,
            self.ctx.allocator.cidr,
        )
        self.stopping.wait()
        self._shutdown()

    def _register(self) -> Obj | None:
        delay = 1.0
        while not self.stopping.is_set():
            try:
                return register(self.ctx.kube, self.ctx.node_name)
            except Exception as exc:
                log.warning("Failed to register node node=%s error=%s retry=%.0fs", self.ctx.node_name, exc, delay)
                self.stopping.wait(delay)
                delay = min(delay * 2, MAX_BACKOFF)
        return None

    def _serve_kubernetes_service(self) -> None:
        """The `kubernetes` Service variables for pods, and the relay behind its ClusterIP (see apiservice)."""
        try:
            service = apiservice.service_address(self.ctx.kube.read_service("default", "kubernetes"))
        except Exception as exc:  # the API server's address still works
            log.warning("Failed to read the kubernetes Service error=%s", exc)
            service = None
        env, self._relay = apiservice.start(service, apiservice.upstream_of(self.ctx.kube.server))
        self.ctx.service_env = env

    def _shutdown(self) -> None:
        log.info("Stopping process node node=%s pods=%d", self.ctx.node_name, len(self._workers))
        with self._lock:
            workers = list(self._workers.values())
        for worker in workers:
            worker.stop_for_shutdown()
        deadline = time.monotonic() + self.ctx.shutdown_grace + 5
        for worker in workers:
            worker.join(max(deadline - time.monotonic(), 0.1))
        alive = [w.label for w in workers if w.is_alive()]
        if alive:
            log.warning("Pod workers still stopping at exit pods=%s", alive)
        if self._relay is not None:
            self._relay.stop()
        log.info("Stopped process node node=%s", self.ctx.node_name)

    # --- the watch --------------------------------------------------------------------------------------
    def _watch_forever(self) -> None:
        delay = 1.0
        while not self.stopping.is_set():
            try:
                version = self._relist()
                delay = 1.0
                while not self.stopping.is_set():
                    version = self._watch(version)
            except _GoneError:
                log.info("Watch expired, listing pods again node=%s", self.ctx.node_name)
            except Exception as exc:
                log.warning("Pod watch failed node=%s error=%s retry=%.0fs", self.ctx.node_name, exc, delay)
                self.stopping.wait(delay)
                delay = min(delay * 2, MAX_BACKOFF)

    def _relist(self) -> str:
        pods, version = self.ctx.kube.list_pods(self.ctx.node_name)
        listed = {pod["metadata"]["uid"] for pod in pods}
        for pod in pods:
            self._handle(pod, deleted=False)
        with self._lock:
            gone = [worker for uid, worker in self._workers.items() if uid not in listed]
        for worker in gone:
            worker.vanish()
        return version

    def _watch(self, version: str) -> str:
        """Follow the watch until it ends; return the last resourceVersion seen."""
        try:
            for event in self.ctx.kube.watch_pods(self.ctx.node_name, version, WATCH_SECONDS):
                if self.stopping.is_set():
                    break
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise _GoneError
                    raise RuntimeError(f"watch error: {obj.get('message')}")
                version = obj.get("metadata", {}).get("resourceVersion") or version
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self._handle(obj, deleted=kind == "DELETED")
        except ApiException as exc:
            if exc.status == 410:
                raise _GoneError from exc
            raise
        return version

    def _handle(self, pod: Obj, deleted: bool) -> None:
        uid = pod["metadata"]["uid"]
        with self._lock:
            worker = self._workers.get(uid)
            if worker is not None:
                if deleted:
                    worker.vanish()
                else:
                    worker.update(pod)
                return
            if deleted:
                return
            meta, phase = pod["metadata"], pod.get("status", {}).get("phase")
            if meta.get("deletionTimestamp"):
                # Terminating and not ours to run (e.g. found after a restart): nothing to stop, just finish.
                threading.Thread(target=self._finish_deletion, args=(pod,), daemon=True).start()
                return
            if phase in ("Succeeded", "Failed"):
                return  # A finished pod never runs again.
            worker = PodWorker(self.ctx, pod, self._worker_done)
            self._workers[uid] = worker
        worker.start()

    def _finish_deletion(self, pod: Obj) -> None:
        meta = pod["metadata"]
        try:
            self.ctx.kube.delete_pod_now(meta.get("namespace", "default"), meta["name"], meta["uid"])
        except Exception as exc:
            log.warning("Failed to delete pod pod=%s/%s error=%s", meta.get("namespace"), meta["name"], exc)

    def _worker_done(self, worker: PodWorker) -> None:
        with self._lock:
            if self._workers.get(worker.uid) is worker:
                del self._workers[worker.uid]
