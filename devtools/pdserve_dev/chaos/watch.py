"""Every engine's kv-compat mismatch counter, read while a rollout runs engines of two values side by side.

The simulator refuses a KV pull between engines of different kv-compat values (as vLLM's NIXL compatibility check
does) and counts it on both engines in `pdserve:sim_kv_compat_mismatch_total`. A pod's counter goes with the pod,
so the watcher polls every engine pod all along and keeps the highest value it saw per pod incarnation (UID);
a pod gone between two polls keeps what it last reported. It also counts polls that found Ready engines of two
values at once: the proof that the rollout did give a router the chance to pair them.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

from pdserve_dev.chaos.service import ENGINE_PORT, ENGINES
from pdserve_dev.testing.cluster import ClusterHelper
from pdserve_dev.testing.cluster import pod_ready as ready
from pdserve_dev.testing.metrics import metric_value, scrape_sync

MISMATCH = "pdserve:sim_kv_compat_mismatch_total"


@dataclass
class MismatchWatcher:
    """`start()`, then `stop()` (which polls once more); read `mismatches`, `mixed_polls`, `polls`."""

    cluster: ClusterHelper
    namespace: str
    interval: float = 0.5
    mismatches: dict[str, float] = field(default_factory=dict)
    mixed_polls: int = 0
    polls: int = 0
    mixed: threading.Event = field(default_factory=threading.Event)
    """Set while the last poll found Ready engines of two values (a load can count what it sent meanwhile)."""
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @property
    def total(self) -> float:
        return sum(self.mismatches.values())

    def start(self) -> MismatchWatcher:
        self._thread = threading.Thread(target=self._run, daemon=True, name="mismatch-watcher")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.poll()  # the last word of every engine still running

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # a kubectl racing a deletion: the next poll sees the pod
                self.poll()
            self._stop.wait(self.interval)

    def poll(self) -> None:
        values = set()
        for pod in self.cluster.pods(self.namespace, ENGINES):
            ip, uid = pod.get("status", {}).get("podIP"), pod["metadata"]["uid"]
            if ready(pod):
                values.add(pod["metadata"]["labels"].get("pdserve.io/kv-compat"))
            if ip:
                with contextlib.suppress(OSError):
                    found = metric_value(scrape_sync(f"http://{ip}:{ENGINE_PORT}/metrics", timeout=2), MISMATCH)
                    self.mismatches[uid] = max(found, self.mismatches.get(uid, 0.0))
        self.polls += 1
        if len(values) > 1:
            self.mixed_polls += 1
            self.mixed.set()
        else:
            self.mixed.clear()
