"""The pure renderer: `render(validate(pdservice)) -> list of Kubernetes objects`. No API calls, clock or randomness.

The operator applies exactly this list (server-side apply) and prunes owned objects that are not in it; the CLI
prints it (`pdserve render`). Objects come in dependency order (config and RBAC before the workloads that use
them) so a plain `kubectl apply -f` of the output also works.
"""

from __future__ import annotations

from typing import Any

from pdserve.api.validation import InvalidSpecError, Validated
from pdserve_operator.names import ENGINE_ROLES
from pdserve_operator.render import discovery, engine, gateway, kvcache, router
from pdserve_operator.render.discovery import NOTHING_OBSERVED, Observed

__all__ = ["NOTHING_OBSERVED", "InvalidSpecError", "Observed", "render"]


def render(checked: Validated, observed: Observed = NOTHING_OBSERVED) -> list[dict[str, Any]]:
    """Every object the operator manages for a validated PDService (`pdserve.api.validation.validate`).

    Takes the validation result, not a bare PDService, so the spec is parsed and checked once per caller and the
    renderer reads the effective spec validation already resolved. Raises InvalidSpecError if it has problems.
    `observed` is what the operator knows of the cluster that the objects depend on (the kv-compat values the pods
    carry, the labels of their nodes: `render.discovery`); the default renders a PDService that has no pods yet.
    """
    pds, spec = checked.require()
    objects: list[dict[str, Any]] = [
        router.service_account(pds),
        router.role(pds, spec),
        router.role_binding(pds),
        router.config_map(pds, spec),
        discovery.discovery_config_map(pds, spec, observed),
    ]
    control = router.control_config_map(pds, spec, observed)
    if control is not None:
        objects.append(control)
    objects += kvcache.objects(pds, spec)
    for role in ENGINE_ROLES:
        objects += [
            engine.headless_service(pds, spec, role),
            *discovery.kv_compat_services(pds, spec, observed, role),
            engine.statefulset(pds, spec, role),
            engine.disruption_budget(pds, spec, role),
        ]
    objects += [router.service(pds, spec), router.deployment(pds, spec), router.disruption_budget(pds)]
    if gateway.enabled(spec):
        return gateway.objects(pds, spec, objects)
    return objects
