"""status.inferencePool (router mode gateway): the pool pdserve renders and what the gateways say of it (pure).

A Gateway API implementation that routes an HTTPRoute to the InferencePool writes one entry per parent (Gateway)
into the pool's `status.parents[]`, with conditions `Accepted` (the gateway took the pool) and `ResolvedRefs` (it
found the endpoint picker's Service). pdserve reports each parent as `kind/namespace/name` with both verdicts and,
when one is not True, its reason and message: the first place a user looks when requests do not arrive.
An empty list means no gateway references the pool yet (an HTTPRoute is missing or not accepted).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdserve.api.v1alpha1 import InferencePoolParentStatus, InferencePoolStatus

# The refresh interval of the pool's status while in router mode gateway: the operator does not watch pools (their
# CRD is optional), so it reads its own pool at least this often.
REFRESH_SECONDS = 30.0


def _parent_name(ref: Mapping[str, Any]) -> str:
    kind = ref.get("kind") or "Gateway"
    return f"{kind}/{ref.get('namespace') or ''}/{ref.get('name') or ''}"


def inference_pool_status(name: str, pool: Mapping[str, Any] | None) -> dict[str, Any]:
    """The `inferencePool` status block (camelCase, as written) from the pool object read from the API server."""
    parents: list[InferencePoolParentStatus] = []
    for parent in ((pool or {}).get("status") or {}).get("parents") or []:
        conditions = {c.get("type"): c for c in parent.get("conditions") or [] if isinstance(c, Mapping)}
        accepted, resolved = (conditions.get(t, {}).get("status") == "True" for t in ("Accepted", "ResolvedRefs"))
        message = ""
        for type_ in ("Accepted", "ResolvedRefs"):
            condition = conditions.get(type_)
            if condition is None:
                message = f"{type_}: not reported yet"
                break
            if condition.get("status") != "True":
                message = f"{type_}: {condition.get('reason', '')}: {condition.get('message', '')}"
                break
        parents.append(
            InferencePoolParentStatus(
                parent=_parent_name(parent.get("parentRef") or {}),
                accepted=accepted,
                resolved_refs=resolved,
                message=message,
            )
        )
    return InferencePoolStatus(name=name, parents=parents).model_dump(by_alias=True)
