"""Does an observed object still carry what we would apply? The no-op detector behind "a reconcile that changes
nothing writes nothing".

Server-side apply is idempotent, but every apply is still a write request (and, for some kinds, a new
resourceVersion and a watch event for everyone). So the operator applies a child only when one of two things holds:

1. The desired object changed since the last apply. Each applied object carries `pdserve.io/applied-hash`, a hash
   of exactly what was applied; a different hash means the spec (or the renderer) changed. This also catches
   fields we *stopped* setting, which a containment check alone cannot see.
2. Somebody changed one of our fields (drift). `contains(desired, observed)` checks that every field we set is
   present in the observed object with an equal value. Fields we do not set are ignored, mirroring server-side
   apply: others may own them and our apply would not touch them anyway.

Containment rules (what the API server does to an object between apply and read-back):
- Maps: every desired key must be contained; extra observed keys are defaults or other managers' fields.
- Lists of maps that all have a `name` (containers, env, ports, volumes, ...) are map-lists keyed by name in the
  API: match items by name, ignore extra observed items (another manager's entries survive our apply).
- Other lists (args, tolerations, ...) are atomic: same length, item by item.
- Empty desired values (`{}`, `[]`, `""`, None) match a missing observed field: Go's `omitempty` drops them (an
  env var with `value: ""` or a toleration with `key: ""` reads back without that field).
- Quantities are compared by value ("0.5" == "500m"); the API server canonicalises them.
- Ints and strings are compared as written, except an int-or-string port that the server leaves alone.
"""

from __future__ import annotations

import copy
import hashlib
import json
from decimal import Decimal, InvalidOperation
from typing import Any

from kubernetes.utils import parse_quantity

APPLIED_HASH_ANNOTATION = "pdserve.io/applied-hash"


def applied_hash(obj: dict[str, Any]) -> str:
    """A stable hash of an object as we would apply it (without the hash annotation itself)."""
    clean = copy.deepcopy(obj)
    annotations = clean.get("metadata", {}).get("annotations", {})
    annotations.pop(APPLIED_HASH_ANNOTATION, None)
    if not annotations:
        clean.get("metadata", {}).pop("annotations", None)
    canonical = json.dumps(clean, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:20]


def stamp(obj: dict[str, Any]) -> dict[str, Any]:
    """A copy of `obj` carrying its applied-hash annotation: what the operator actually applies."""
    stamped = copy.deepcopy(obj)
    metadata = stamped.setdefault("metadata", {})
    metadata.setdefault("annotations", {})[APPLIED_HASH_ANNOTATION] = applied_hash(obj)
    return stamped


def apply_reason(stamped: dict[str, Any], observed: dict[str, Any] | None) -> str | None:
    """Why `stamped` must be applied over `observed`, or None when the apply would change nothing we own."""
    if observed is None:
        return "missing"
    want = stamped.get("metadata", {}).get("annotations", {}).get(APPLIED_HASH_ANNOTATION)
    have = (observed.get("metadata", {}).get("annotations") or {}).get(APPLIED_HASH_ANNOTATION)
    if want != have:
        return "changed"
    path = first_difference(stamped, observed)
    if path is not None:
        return f"drift at {path}"
    return None


def contains(desired: Any, observed: Any) -> bool:
    """True when every field of `desired` is in `observed` with an equal value (see the module docstring)."""
    return first_difference(desired, observed) is None


def first_difference(desired: Any, observed: Any, path: str = "") -> str | None:
    """The dotted path of the first desired field that `observed` lacks or contradicts, or None."""
    if _empty(desired):
        return None if _empty(observed) or observed is None else _mismatch_if_not_empty(desired, observed, path)
    if isinstance(desired, dict):
        if not isinstance(observed, dict):
            return path or "."
        for key, value in desired.items():
            found = first_difference(value, observed.get(key), f"{path}.{key}" if path else key)
            if found is not None:
                return found
        return None
    if isinstance(desired, list):
        if not isinstance(observed, list):
            return path or "."
        if desired and all(isinstance(item, dict) and "name" in item for item in desired):
            by_name = {item.get("name"): item for item in observed if isinstance(item, dict)}
            for item in desired:
                found = first_difference(item, by_name.get(item["name"]), f"{path}[{item['name']}]")
                if found is not None:
                    return found
            return None
        if len(desired) != len(observed):
            return path or "."
        for index, (want, have) in enumerate(zip(desired, observed, strict=True)):
            found = first_difference(want, have, f"{path}[{index}]")
            if found is not None:
                return found
        return None
    return None if _scalar_equal(desired, observed) else (path or ".")


def _empty(value: Any) -> bool:
    # "" too: every string field we render that may be empty (EnvVar.value, Toleration.key/value) is `omitempty`.
    return value is None or value in ({}, [], "")


def _mismatch_if_not_empty(desired: Any, observed: Any, path: str) -> str | None:
    # An empty desired map or list against a non-empty observed one: SSA with an empty map-list or map does not
    # remove other managers' entries, and for atomic lists the server would have dropped the empty value anyway.
    # None against a value means "we do not set this field".
    if desired is None or isinstance(desired, dict):
        return None
    if isinstance(desired, list) and isinstance(observed, list):
        return None if not observed or all(isinstance(i, dict) and "name" in i for i in observed) else path
    return path


def _scalar_equal(desired: Any, observed: Any) -> bool:
    if desired == observed and type(desired) is type(observed):
        return True
    if isinstance(desired, bool) or isinstance(observed, bool):
        return False
    if isinstance(desired, str | int | float) and isinstance(observed, str | int | float):
        return _quantity(desired) is not None and _quantity(desired) == _quantity(observed)
    return False


def _quantity(value: str | int | float) -> Decimal | None:
    try:
        return Decimal(parse_quantity(value))  # type: ignore[no-untyped-call]
    except (ValueError, TypeError, InvalidOperation):
        return None
