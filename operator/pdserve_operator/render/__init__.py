"""The pure renderer: `render(pdservice) -> list of Kubernetes objects`. No API calls, no clock, no randomness.

The operator applies exactly this list (server-side apply) and prunes owned objects that are not in it; the CLI
prints it (`pdserve render`). Objects come in dependency order (config and RBAC before the workloads that use
them) so a plain `kubectl apply -f` of the output also works.
"""

from __future__ import annotations

from typing import Any

from pdserve.api.v1alpha1 import PDService
from pdserve.api.validation import InvalidSpecError, validate_spec
from pdserve_operator.render import engine, router
from pdserve_operator.render.names import ENGINE_ROLES

__all__ = ["InvalidSpecError", "render"]


def render(pds: PDService) -> list[dict[str, Any]]:
    """Every object the operator manages for `pds`. Raises InvalidSpecError if the spec has semantic problems."""
    problems = validate_spec(pds.spec)
    if problems:
        raise InvalidSpecError(problems)
    objects: list[dict[str, Any]] = [
        router.service_account(pds),
        router.role(pds),
        router.role_binding(pds),
        router.config_map(pds),
    ]
    for role in ENGINE_ROLES:
        objects += [
            engine.headless_service(pds, role),
            engine.statefulset(pds, role),
            engine.disruption_budget(pds, role),
        ]
    objects += [router.service(pds), router.deployment(pds), router.disruption_budget(pds)]
    return objects
