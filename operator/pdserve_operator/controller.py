"""The controller: informer cache + work queue + reconcile workers + resync timer, gated by leader election.

kopf's watch handlers (handlers.py) only feed the cache and enqueue the owning PDService; the workers here run the
one level-triggered reconcile path (reconcile.py) in threads (the Kubernetes client is synchronous), one key at a
time per PDService. A periodic resync re-queues every PDService so that drift in objects we do not watch, or a
missed event, is corrected within `resync_seconds`.

The runner hands in what a process has one of: the metrics (`OperatorMetrics`) and the thread pool that applies the
objects of one wave concurrently (`applier`, shared by all workers; the API server, not the pool, is the limit).
Without an applier, a reconcile applies one object after the other in its worker thread. It also hands in the
autoscaler's `ScalingBoard`: the loops (`autoscaler.loop`) leave their reports there and queue the PDService, and
the reconcile writes them into status with everything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Executor
from typing import Any

from pdserve_operator.autoscaler.report import ScalingBoard
from pdserve_operator.kinds import OBSERVED
from pdserve_operator.kube import ApiError, KubeApi, NotLeaderError
from pdserve_operator.metrics import OperatorMetrics
from pdserve_operator.names import MANAGED_BY, MANAGED_BY_LABEL
from pdserve_operator.nodes import NodeLabelCache, NodeLabels
from pdserve_operator.observed import OwnerKey
from pdserve_operator.reconcile import ForeignPods, RetryLaterError, reconcile, utc_now
from pdserve_operator.store import Store
from pdserve_operator.view import SpecViews
from pdserve_operator.workqueue import WorkQueue

CHILD_SELECTOR = f"{MANAGED_BY_LABEL}={MANAGED_BY}"

log = logging.getLogger("pdserve.operator.controller")


class Controller:
    def __init__(
        self,
        api: KubeApi,
        store: Store | None = None,
        *,
        views: SpecViews,
        workers: int,
        resync_seconds: float,
        relist_seconds: float,
        crash_window: float,
        namespaces: Collection[str],
        is_leader: Callable[[], bool] = lambda: True,
        metrics: OperatorMetrics | None = None,
        applier: Executor | None = None,
        scaling: ScalingBoard | None = None,
        nodes: NodeLabels | None = None,
        now: Callable[[], str] = utc_now,
    ) -> None:
        """`views`: each PDService's validation result under the administrator's policy, shared with the
        autoscaler's loops. `workers`, `resync_seconds`, `relist_seconds`, `crash_window`, `namespaces`: the
        process settings of the same names (`pdserve.api.settings.OperatorSettings`; `crash_window` is
        `crash_recovery_seconds`; no namespace: cluster-wide). `now`: the clock of every pass (the API server's
        one-second timestamps; a test freezes it to decide whether a crash is inside its recovery window)."""
        self.api = api
        self.metrics = metrics if metrics is not None else api.metrics
        self.applier = applier
        self.store = store or Store()
        self.queue: WorkQueue[OwnerKey] = WorkQueue()
        self.workers = workers
        self.resync_seconds = resync_seconds
        self.relist_seconds = relist_seconds
        self.namespaces = list(namespaces)  # empty: cluster-wide
        self.is_leader = is_leader
        self.views = views
        self.crash_window = crash_window
        self.now = now
        # The autoscaler loops' reports (the runner's board; None: an operator without the autoscaler wiring).
        self.scaling = scaling
        # Node labels for the router's topology, read through the reconcile's own API client (so counted with it).
        self.nodes = nodes if nodes is not None else NodeLabelCache(api)
        # Pods carrying a PDService's labels that it does not own, already reported (one Event each).
        self.reported = ForeignPods()
        # Set once the first list of every watched kind is in the cache (`run`): no pass runs before.
        self.synced = asyncio.Event()

    # ------------------------------------------------------------------------------------------ event intake

    def on_owner_event(self, event: Mapping[str, Any]) -> None:
        obj = event.get("object") or {}
        if not obj.get("metadata"):
            return
        meta = obj["metadata"]
        namespace, name = meta.get("namespace", "default"), meta["name"]
        if event.get("type") == "DELETED":
            self.store.delete_owner(namespace, name)
            self.views.forget(namespace, name)
            log.info("Forgot deleted PDService pdservice=%s/%s", namespace, name)
            return
        self.store.put_owner(dict(obj))
        self.enqueue((namespace, name))

    def on_child_event(self, event: Mapping[str, Any]) -> None:
        obj = event.get("object") or {}
        if not obj.get("metadata") or "kind" not in obj:
            return
        owner = self.store.delete(obj) if event.get("type") == "DELETED" else self.store.put(dict(obj))
        self.metrics.cached_objects.set(self.store.size())
        if owner is not None and self.store.owner(*owner) is not None:
            self.enqueue(owner)

    def enqueue(self, key: OwnerKey) -> None:
        if self.is_leader():
            self.queue.add(key)
            self.metrics.queue_depth.set(len(self.queue))

    def enqueue_all(self) -> None:
        for key in self.store.owner_keys():
            self.enqueue(key)

    # ---------------------------------------------------------------------------------------------- workers

    async def run(self, stop: asyncio.Event) -> None:
        """Fill the cache with every child that exists, then reconcile until `stop`.

        No pass runs before that first list: kopf delivers each kind's watch on its own, and a PDService's event
        can come before its StatefulSets'. A pass on that half-filled cache would see the children as missing and
        "create" them, applying the spec's replicas over what an autoscaler set (found by the chaos benchmark: a
        restarted operator reset both pools mid-rollout). This is what controller-runtime's WaitForCacheSync does."""
        if not await self._sync(stop):
            return
        tasks = [asyncio.create_task(self._worker(i)) for i in range(self.workers)]
        tasks.append(asyncio.create_task(self._resync(stop)))
        tasks.append(asyncio.create_task(self._relist(stop)))
        try:
            await stop.wait()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _sync(self, stop: asyncio.Event, max_delay: float = 30.0) -> bool:
        """The first list of every watched kind, retried with backoff while the API server refuses it (the
        operator stays up and says why). True once the cache is filled; False when stopped before that."""
        delay = 0.5
        while not stop.is_set():
            try:
                await asyncio.to_thread(self.relist)
            except ApiError as exc:
                log.warning("Failed to list children before reconciling retry_in=%.1fs error=%s", delay, exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)
                delay = min(delay * 2, max_delay)
                continue
            self.synced.set()
            log.info("Cache synced objects=%d", self.store.size())
            return True  # every owner in the store was queued by its event (or by taking the lead): none to add
        return False

    async def _resync(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.sleep(self.resync_seconds)
            self.enqueue_all()

    async def _relist(self, stop: asyncio.Event) -> None:
        """Every `relist_seconds`, list each watched kind once (by the managed-by label, not per PDService) and
        replace the cache's copy: a safety net for deletions a watch restart may have missed."""
        while not stop.is_set():
            await asyncio.sleep(self.relist_seconds)
            try:
                dropped = await asyncio.to_thread(self.relist)
            except ApiError as exc:
                log.warning("Failed to relist children error=%s", exc)
                continue
            if dropped:
                log.warning("Dropped stale cache entries count=%d", dropped)
                self.enqueue_all()

    def relist(self) -> int:
        dropped = 0
        scopes: list[str | None] = list(self.namespaces) or [None]
        for kind in OBSERVED:
            objects = []
            versions = []
            for namespace in scopes:
                items, version = self.api.list_at(kind.collection_path(namespace), kind.kind, CHILD_SELECTOR)
                versions.append(version)
                for item in items:
                    item.setdefault("apiVersion", kind.api_version)
                    item.setdefault("kind", kind.kind)
                    objects.append(item)
            dropped += self.store.replace_kind(kind.kind, self.namespaces or None, objects, versions)
        self.metrics.cached_objects.set(self.store.size())
        return dropped

    async def _worker(self, index: int) -> None:
        while True:
            key = await self.queue.get()
            self.metrics.queue_depth.set(len(self.queue))
            try:
                if self.is_leader():
                    await self._process(key)
            finally:
                self.queue.done(key)

    async def _process(self, key: OwnerKey) -> None:
        namespace, name = key
        started = time.perf_counter()
        try:
            outcome = await asyncio.to_thread(
                reconcile,
                namespace,
                name,
                self.store,
                self.api,
                self.now,
                views=self.views,
                crash_window=self.crash_window,
                applier=self.applier,
                scaling=self.scaling,
                nodes=self.nodes,
                reported=self.reported,
            )
        except NotLeaderError:
            log.warning("Stopped reconciling: leadership lost pdservice=%s/%s", namespace, name)
            self.metrics.reconciles.labels("not_leader").inc()
            return
        except RetryLaterError as exc:
            delay = self.queue.retry(key)
            self.metrics.reconciles.labels("error").inc()
            self.metrics.reconcile_errors.inc()
            log.warning("Retrying reconcile pdservice=%s/%s delay=%.1fs error=%s", namespace, name, delay, exc)
            return
        except Exception:
            delay = self.queue.retry(key)
            self.metrics.reconciles.labels("error").inc()
            self.metrics.reconcile_errors.inc()
            log.exception("Reconcile crashed pdservice=%s/%s delay=%.1fs", namespace, name, delay)
            return
        finally:
            self.metrics.reconcile_seconds.observe(time.perf_counter() - started)
        self.queue.forget(key)
        if outcome.requeue_after is not None:
            # The status changes by itself then (a crash's recovery window ends): no event would trigger that pass.
            self.queue.add_after(key, outcome.requeue_after)
        self.metrics.reconciles.labels(outcome.result).inc()
        if outcome.result not in ("noop", "gone"):
            log.info(
                "Reconciled pdservice=%s/%s result=%s applied=%d pruned=%d status_written=%s seconds=%.3f",
                namespace,
                name,
                outcome.result,
                len(outcome.applied),
                len(outcome.pruned),
                outcome.status_written,
                time.perf_counter() - started,
            )
