"""The labels of the nodes engine pods run on, read by name and cached: what the router's discovery ConfigMap
publishes.

Why read by name rather than watch: a Node watch streams every node of the cluster, with its whole status, into the
operator, for a few labels of the few nodes that host engines. Topology labels (zone, rack, NVLink domain) are set
when a node joins and do not change while pods run on it (the scheduler's topology spreading assumes as much), so
one GET per node, when an engine pod first lands on it, is enough; an entry is read again after `ttl_seconds` in
case a node was relabelled (or deleted and re-created under its name). A reconcile that finds every node cached
makes no request at all, which keeps a no-op pass free.

Failures (403 where the operator may not get nodes, 404 for a node that went away, a connection error) leave the
node out: the router then treats its engines' domain as unknown (topology only ever weighs a score, it never
decides a pairing). A failed read is retried after `retry_seconds`, not on every pass, and logged once per node
and failure episode.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from pdserve_operator.kube import ApiError

log = logging.getLogger("pdserve.operator.nodes")


class NodeReader(Protocol):
    """Reads one Node (`KubeApi.node`; the reconcile tests' `FakeKube.node`). Raises ApiError."""

    def node(self, name: str) -> dict[str, Any]: ...


class NodeLabels(Protocol):
    """What a reconcile asks: the labels of these nodes (those it could read)."""

    def labels(self, names: Iterable[str]) -> dict[str, Mapping[str, str]]: ...


@dataclass
class _Entry:
    labels: Mapping[str, str] | None  # None: the last read failed
    read_at: float


class NodeLabelCache:
    """Thread-safe (reconcile workers share it). Two workers may read the same uncached node at once: harmless."""

    def __init__(
        self,
        reader: NodeReader,
        *,
        ttl_seconds: float = 600.0,
        retry_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._reader = reader
        self._ttl = ttl_seconds
        self._retry = retry_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}

    def labels(self, names: Iterable[str]) -> dict[str, Mapping[str, str]]:
        found: dict[str, Mapping[str, str]] = {}
        for name in sorted(set(names)):
            entry = self._fresh(name)
            if entry is None:
                entry = self._read(name)
            if entry.labels is not None:
                found[name] = entry.labels
        return found

    def _fresh(self, name: str) -> _Entry | None:
        with self._lock:
            entry = self._entries.get(name)
        if entry is None:
            return None
        age = self._clock() - entry.read_at
        return entry if age < (self._ttl if entry.labels is not None else self._retry) else None

    def _read(self, name: str) -> _Entry:
        try:
            node = self._reader.node(name)
        except ApiError as exc:
            with self._lock:
                previous = self._entries.get(name)
            if previous is None or previous.labels is not None:
                log.warning("Failed to read node labels node=%s error=%s retry_in=%.0fs", name, exc, self._retry)
            entry = _Entry(None, self._clock())
        else:
            labels = (node.get("metadata") or {}).get("labels") or {}
            entry = _Entry({str(k): str(v) for k, v in labels.items()}, self._clock())
        with self._lock:
            self._entries[name] = entry
        return entry
