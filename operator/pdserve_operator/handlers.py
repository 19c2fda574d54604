"""kopf registration only: watch PDServices and every child kind, feed the controller, log in. No reconcile logic.

All handlers are `on.event` (level-triggered, no kopf bookkeeping written to objects) and return None. Child kinds
are watched with a server-side label selector (`app.kubernetes.io/managed-by=pdserve-operator`), so the operator
never streams the cluster's unrelated Pods or ConfigMaps.

kopf's watches log in with the same credentials as the reconciler: the login handler converts the Configuration that
`pdserve.api.kubeclient` loads (--kubeconfig, then $KUBECONFIG, then in-cluster) instead of kopf's own client login,
which tries in-cluster first and would let the watches and the writes reach different API servers.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf
from kubernetes import client as k8s

from pdserve.api.kubeclient import load_configuration
from pdserve.api.v1alpha1 import GROUP, PLURAL, VERSION
from pdserve_operator.controller import CHILD_SELECTOR, Controller
from pdserve_operator.kinds import OBSERVED, Kind


def _matches(kind: Kind) -> Any:
    return lambda resource: resource.group == kind.group and resource.plural == kind.plural


def configure(settings: kopf.OperatorSettings, *, server_timeout: int, client_timeout: int) -> None:
    """kopf settings: bookkeeping in annotations, bounded watches and requests, server-side child selectors."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kopf.pdserve.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="kopf.pdserve.io")
    settings.persistence.finalizer = "kopf.pdserve.io/finalizer"  # never added: there are no deletion handlers
    # The API server ends each watch after server_timeout; the client gives up slightly later if it hears nothing.
    settings.watching.server_timeout = server_timeout
    settings.watching.client_timeout = client_timeout
    settings.watching.connect_timeout = 10
    settings.networking.connect_timeout = 10
    settings.networking.request_timeout = 60
    settings.posting.level = logging.WARNING  # kopf's own events: warnings and errors only
    for kind in OBSERVED:
        settings.watching.label_selectors[_matches(kind)] = CHILD_SELECTOR


def connection_info(configuration: k8s.Configuration, *, trust_env: bool = False) -> kopf.ConnectionInfo:
    """kopf's credentials from a kubernetes client Configuration (what `kopf.login_via_client` extracts, from ours).

    The bearer header is read through `get_api_key_with_prefix`, which runs the refresh hook of exec plugins and
    projected service-account tokens, so a re-login after a 401 picks up a fresh token."""
    header = configuration.get_api_key_with_prefix("BearerToken") or configuration.get_api_key_with_prefix(
        "authorization"
    )
    scheme, _, token = (header or "").rpartition(" ")
    return kopf.ConnectionInfo(
        server=configuration.host,
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        username=configuration.username or None,
        password=configuration.password or None,
        scheme=scheme or None,
        token=token or None,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
        trust_env=trust_env,
    )


def register(controller: Controller, registry: kopf.OperatorRegistry, *, kubeconfig: str | None) -> None:
    @kopf.on.login(registry=registry)
    def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
        return connection_info(load_configuration(kubeconfig), trust_env=settings.networking.trust_env)

    @kopf.on.probe(id="reconciler", registry=registry)
    def probe(**_: Any) -> dict[str, Any]:
        return {"leader": controller.is_leader(), "queued": len(controller.queue), "cached": controller.store.size()}

    async def pdservice_event(event: dict[str, Any], **_: Any) -> None:
        controller.on_owner_event(event)

    kopf.on.event(GROUP, VERSION, PLURAL, id="pdservices", registry=registry)(pdservice_event)  # type: ignore[arg-type]

    for kind in OBSERVED:

        async def child_event(event: dict[str, Any], **_: Any) -> None:
            controller.on_child_event(event)

        kopf.on.event(
            group=kind.group, version=kind.version, plural=kind.plural, id=f"observe-{kind.plural}", registry=registry
        )(child_event)  # type: ignore[arg-type]
