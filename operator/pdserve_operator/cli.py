"""`pdserve operator`: run the PDService operator from a kubeconfig (development) or in-cluster (ServiceAccount).

Every option is a row of `pdserve.api.settings.OperatorSettings` (its default, flag and help text are written there
and nowhere else); this module checks the combinations one option cannot check alone and hands the settings to the
runner, the composition root.
"""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
from typing import Any

import click

from pdserve.api.optioning import click_options, settings_of
from pdserve.api.policy import HOST_PATH_FLAG, Policy, PolicyError
from pdserve.api.settings import OperatorSettings

log = logging.getLogger("pdserve.operator")


@click.command("operator")
@click_options(settings_of(OperatorSettings))
def operator(**values: Any) -> None:
    """Run the PDService operator."""
    settings = OperatorSettings(**values)
    if bool(settings.namespaces) == settings.all_namespaces:
        raise click.UsageError("give either --namespace NS (repeatable) or --all-namespaces")
    if settings.renew_deadline >= settings.lease_seconds:
        raise click.UsageError("--renew-deadline must be shorter than --lease-seconds")
    try:
        policy = Policy.allowing(model_host_paths=settings.model_host_paths)
    except PolicyError as exc:
        raise click.BadParameter(str(exc), param_hint=HOST_PATH_FLAG) from None
    if settings.prometheus_url is not None:
        parsed = urllib.parse.urlsplit(settings.prometheus_url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise click.BadParameter(f"not an http(s) URL: {settings.prometheus_url!r}", param_hint="--prometheus-url")
    from pdserve_operator import logs
    from pdserve_operator.runner import run

    logs.setup(settings.log_format, settings.log_level)
    try:
        import uvloop

        uvloop.run(run(settings, policy))
    except ImportError:  # pragma: no cover - uvloop is a dependency; plain asyncio still works
        asyncio.run(run(settings, policy))
