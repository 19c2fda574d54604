"""The effective view of a stored PDService: its validation result, derived once per stored version.

`pdserve.api.validation.validate` parses a PDService and checks it once, and its result (`Validated`) carries the
model and its effective spec (every default applied), or every problem. The reconcile and the autoscaler's loop
both start from it; this module is the one place that turns a stored object into it:

- the document validated is what the user wrote: `status` is the operator's own and is left out (`spec_document`);
- the cluster's policy (the operator's flags, e.g. which node paths may hold model weights) is the one the
  process was started with;
- a stored version (its UID and resourceVersion) is validated once: the reconcile's pass, the autoscaler's tick
  and the next resync of an unchanged object share the result instead of parsing and checking it again. An
  object without a resourceVersion (never stored) is validated every time and not remembered.

Everything above takes the `Validated` (or its effective spec) from here and never derives it from a raw
PDService again.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from pdserve.api.policy import Policy
from pdserve.api.validation import Validated, validate
from pdserve_operator.observed import OwnerKey

_Version = tuple[str | None, str]  # (uid, resourceVersion)


def spec_document(body: Mapping[str, Any]) -> dict[str, Any]:
    """The stored object without its status: what validation and the models see (status is ours and kopf-free)."""
    return {key: value for key, value in body.items() if key != "status"}


class SpecViews:
    """The validation result of every stored PDService, one per stored version. Thread-safe: reconcile workers and
    the autoscaler's loops read it concurrently."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._lock = threading.Lock()
        self._views: dict[OwnerKey, tuple[_Version, Validated]] = {}

    def checked(self, body: Mapping[str, Any]) -> Validated:
        """The validation result of `body` (a stored PDService) under this process's policy."""
        meta = body.get("metadata") or {}
        version = meta.get("resourceVersion")
        if not version:
            return validate(spec_document(body), self.policy)
        key = (meta.get("namespace", "default"), meta.get("name", ""))
        stamp = (meta.get("uid"), str(version))
        with self._lock:
            known = self._views.get(key)
        if known is not None and known[0] == stamp:
            return known[1]
        # Validated outside the lock: two threads racing on a new version both validate it, and both results are
        # equal, so whichever lands last is as good as the other.
        result = validate(spec_document(body), self.policy)
        with self._lock:
            self._views[key] = (stamp, result)
        return result

    def forget(self, namespace: str, name: str) -> None:
        """Drop a deleted PDService's view (the cache keeps one per PDService, never more)."""
        with self._lock:
            self._views.pop((namespace, name), None)

    def size(self) -> int:
        with self._lock:
            return len(self._views)
