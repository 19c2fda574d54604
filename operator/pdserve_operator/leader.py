"""Leader election on a coordination.k8s.io/v1 Lease, so that only one operator replica ever writes.

Why a Lease and not kopf's peering: kopf peering needs its own KopfPeering CRDs, and two replicas with the same
priority both keep running (kopf only warns), so a plain Deployment with 2 replicas would double-act. A Lease is
built into every cluster, is what kube-controller-manager and controller-runtime use, and has well-understood
timing. Non-leaders keep their watches and cache warm and only stop *acting*; on takeover they reconcile everything.

Timing (client-go's defaults): lease 15 s, renew deadline 10 s, retry 2 s. The leader stops acting when it could not
renew for `renew_deadline`, strictly before anyone may take over (`lease_duration` after they last saw the lease
change, measured on *their* clock, so clock skew between nodes does not matter). Every write checks `is_leader()`.
The `pdserve_operator_leader` gauge lives in the OperatorMetrics of the elector's KubeApi (the runner's).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime

from pdserve_operator.kinds import LEASE
from pdserve_operator.kube import ApiError, KubeApi

log = logging.getLogger("pdserve.operator.leader")


def _micro_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseElector:
    def __init__(
        self,
        api: KubeApi,
        *,
        namespace: str,
        name: str,
        identity: str,
        lease_seconds: float,
        renew_deadline: float,
        retry_period: float,
        on_started_leading: Callable[[], None] = lambda: None,
    ) -> None:
        self.api, self.namespace, self.name, self.identity = api, namespace, name, identity
        self.lease_seconds, self.renew_deadline, self.retry_period = lease_seconds, renew_deadline, retry_period
        self.on_started_leading = on_started_leading
        self._renewed_at = 0.0  # monotonic time of our last successful acquire/renew
        self._observed: tuple[str, str] | None = None  # (holder, renewTime) last seen
        self._observed_at = 0.0  # monotonic time we last saw the lease change
        self._leading = False

    def is_leader(self) -> bool:
        return self._leading and time.monotonic() - self._renewed_at < self.renew_deadline

    async def run(self, stop: asyncio.Event) -> None:
        """Try to acquire/renew every retry period until `stop`; release the lease on the way out."""
        try:
            while not stop.is_set():
                try:
                    acquired = await asyncio.to_thread(self.try_acquire_or_renew)
                except ApiError as exc:
                    acquired = False
                    log.warning("Failed to renew lease lease=%s/%s error=%s", self.namespace, self.name, exc)
                self._update(acquired)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.retry_period)
        finally:
            if self._leading:
                await asyncio.to_thread(self.release)
            self._leading = False
            self.api.metrics.leader.set(0)

    def _update(self, acquired: bool) -> None:
        now = time.monotonic()
        if acquired:
            self._renewed_at = now
        leading = self.is_leader() if self._leading else acquired
        if leading and not self._leading:
            log.info("Became the leader lease=%s/%s identity=%s", self.namespace, self.name, self.identity)
            self._leading = True
            self.api.metrics.leader.set(1)
            self.on_started_leading()
        elif not leading and self._leading:
            log.warning("Lost the leader lease lease=%s/%s identity=%s", self.namespace, self.name, self.identity)
            self._leading = False
            self.api.metrics.leader.set(0)

    def try_acquire_or_renew(self) -> bool:
        path = LEASE.object_path(self.namespace, self.name)
        now = time.monotonic()
        try:
            lease = self.api.get(path, LEASE.kind)
        except ApiError as exc:
            if not exc.not_found:
                raise
            body = {
                "apiVersion": LEASE.api_version,
                "kind": LEASE.kind,
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": self._spec(transitions=0, acquire=True),
            }
            try:
                self.api.create_raw(LEASE.collection_path(self.namespace), LEASE.kind, body)
            except ApiError as create_exc:
                if create_exc.conflict:
                    return False  # somebody else created it first
                raise
            return True
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        seen = (holder, str(spec.get("renewTime")))
        if seen != self._observed:
            self._observed, self._observed_at = seen, now
        duration = float(spec.get("leaseDurationSeconds") or self.lease_seconds)
        expired = now - self._observed_at > duration
        if holder and holder != self.identity and not expired:
            return False
        transitions = int(spec.get("leaseTransitions") or 0) + (0 if holder == self.identity else 1)
        lease["spec"] = self._spec(transitions, acquire=holder != self.identity, previous=spec)
        try:
            self.api.replace_raw(path, LEASE.kind, lease)  # resourceVersion in the body: optimistic lock
        except ApiError as exc:
            if exc.conflict:
                return False
            raise
        return True

    def _spec(self, transitions: int, acquire: bool, previous: dict[str, object] | None = None) -> dict[str, object]:
        stamp = _micro_now()
        acquired = stamp if acquire or previous is None else previous.get("acquireTime", stamp)
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": int(self.lease_seconds),
            "acquireTime": acquired,
            "renewTime": stamp,
            "leaseTransitions": transitions,
        }

    def release(self) -> None:
        """Hand the lease back on shutdown so a standby takes over in one retry period, not a lease duration."""
        path = LEASE.object_path(self.namespace, self.name)
        try:
            lease = self.api.get(path, LEASE.kind)
            if (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            lease["spec"]["holderIdentity"] = ""
            lease["spec"]["leaseDurationSeconds"] = 1
            self.api.replace_raw(path, LEASE.kind, lease)
            log.info("Released the leader lease lease=%s/%s", self.namespace, self.name)
        except ApiError as exc:
            log.warning("Failed to release lease lease=%s/%s error=%s", self.namespace, self.name, exc)
