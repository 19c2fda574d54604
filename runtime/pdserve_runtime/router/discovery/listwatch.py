"""One watched collection of Kubernetes objects, kept on the event loop: list, then watch, in a daemon thread.

The same loop as the pools' EndpointSlice watches of `kubernetes.py` (the `kubernetes` client's list-then-watch
with raw JSON objects, every change handed to the event loop with `call_soon_threadsafe`, any error restarting it
after a backoff of 0.5 s doubling to 30 s), for the router's other watches: the router Service's EndpointSlices
(`peers`) and the router control ConfigMap (`control`). The event loop thread alone sees the objects; `on_change`
gets the whole collection (name -> object) after the first list and after every change.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger("pdserve.router.discovery")

Objects = Mapping[str, Mapping[str, Any]]


class ListWatch:
    """`list_fn(namespace, **query)` listed and watched until `stop()`; `on_change(objects)` on the loop thread."""

    def __init__(
        self,
        name: str,
        list_fn: Callable[..., Any],
        namespace: str,
        query: dict[str, str],
        on_change: Callable[[Objects], None],
    ) -> None:
        self.name = name
        self._list_fn = list_fn
        self._namespace = namespace
        self._query = query
        self._on_change = on_change
        self._objects: dict[str, Mapping[str, Any]] = {}
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start watching (call on the event loop thread)."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name=f"pdserve-watch-{self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        from kubernetes import watch

        backoff = 0.5
        query = self._query
        while not self._stop.is_set():
            try:
                listed = self._list_fn(self._namespace, _preload_content=False, _request_timeout=30, **query)
                data = json.loads(listed.data)
                self._post(None, data.get("items") or [])
                backoff = 0.5
                watcher = watch.Watch()  # type: ignore[no-untyped-call]
                for event in watcher.stream(  # type: ignore[no-untyped-call]
                    self._list_fn,
                    self._namespace,
                    resource_version=data["metadata"]["resourceVersion"],
                    timeout_seconds=60,
                    allow_watch_bookmarks=True,
                    _request_timeout=90,
                    **query,
                ):
                    if self._stop.is_set():
                        watcher.stop()  # type: ignore[no-untyped-call]
                        return
                    kind, raw = event.get("type"), event.get("raw_object")
                    if kind in ("ADDED", "MODIFIED", "DELETED") and isinstance(raw, dict):
                        self._post(kind, [raw])
                    elif kind == "ERROR":
                        raise RuntimeError(f"watch error event: {raw}")
                # A watch that ends normally (server timeout) is simply restarted after a fresh list.
            except Exception as exc:  # the API server may fail in any way; never kill the thread
                if self._stop.is_set():
                    return
                log.warning("Failed watching %s namespace=%s query=%s error=%s retry_in=%.1fs", self.name,
                            self._namespace, query, exc, backoff)  # fmt: skip
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)

    def _post(self, kind: str | None, objects: list[Mapping[str, Any]]) -> None:
        """Apply a list (kind None) or one event on the loop thread, then report the collection."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        def apply() -> None:
            if kind is None:
                self._objects = {obj["metadata"]["name"]: obj for obj in objects}
            elif kind == "DELETED":
                for obj in objects:
                    self._objects.pop(obj["metadata"]["name"], None)
            else:
                for obj in objects:
                    self._objects[obj["metadata"]["name"]] = obj
            self._on_change(dict(self._objects))

        with contextlib.suppress(RuntimeError):  # the loop is shutting down
            loop.call_soon_threadsafe(apply)
