"""Where a Kubernetes client finds its cluster and credentials: one order for every pdserve process.

The operator, the router's discovery, the local cluster's tooling and the process node all build their clients
here, so the same environment always reaches the same API server. The order is controller-runtime's (and close to
kubectl's); the first source that is present wins, and a present source that fails to load is an error rather than
a silent fall-through to the next (a typo in `--kubeconfig` must not quietly talk to another cluster):

1. explicit: a kubeconfig path the caller was given (the operator's `--kubeconfig` flag, a test's cluster);
2. `$KUBECONFIG`: one kubeconfig or several joined with `os.pathsep`, merged like kubectl merges them;
3. in-cluster: the pod's service account (`token` and `ca.crt` under `SERVICE_ACCOUNT_DIR`) and the API server
   address from `KUBERNETES_SERVICE_HOST` / `KUBERNETES_SERVICE_PORT`; all three must be there;
4. `~/.kube/config`, the developer's default, only when nothing above applies (controller-runtime's last resort).

`resolve` is the pure decision (which source, which path) and is what the unit tests pin down; `load_configuration`
loads it with the official client's own loaders, which handle every kubeconfig auth method (client certificates,
tokens, exec plugins) and refresh a projected service-account token.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.config.incluster_config import InClusterConfigLoader

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
HOME_KUBECONFIG = Path("~/.kube/config")
SERVICE_HOST_ENV = "KUBERNETES_SERVICE_HOST"
SERVICE_PORT_ENV = "KUBERNETES_SERVICE_PORT"

Origin = Literal["explicit", "KUBECONFIG", "in-cluster", "home"]


class KubeConfigError(Exception):
    """No source of Kubernetes client configuration, or the chosen one could not be loaded."""


@dataclass(frozen=True)
class Source:
    """The configuration source `resolve` picked: its origin and the file(s) or directory it reads."""

    origin: Origin
    path: str

    def describe(self) -> str:
        return {
            "explicit": f"kubeconfig {self.path}",
            "KUBECONFIG": f"$KUBECONFIG ({self.path})",
            "in-cluster": f"the in-cluster service account ({self.path})",
            "home": f"the default kubeconfig {self.path}",
        }[self.origin]


def resolve(
    kubeconfig: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] = os.environ,
    service_account_dir: Path = SERVICE_ACCOUNT_DIR,
    home_kubeconfig: Path = HOME_KUBECONFIG,
) -> Source:
    """The source a client should load, by the module's order. Raises KubeConfigError when there is none."""
    if kubeconfig:
        return Source("explicit", os.fspath(kubeconfig))
    if environ.get("KUBECONFIG"):
        return Source("KUBECONFIG", environ["KUBECONFIG"])
    if environ.get(SERVICE_HOST_ENV) and environ.get(SERVICE_PORT_ENV) and (service_account_dir / "token").is_file():
        return Source("in-cluster", str(service_account_dir))
    home = home_kubeconfig.expanduser()
    if home.is_file():
        return Source("home", str(home))
    raise KubeConfigError(
        "No Kubernetes client configuration: give a kubeconfig (--kubeconfig), set $KUBECONFIG, run in a pod with a "
        f"service account ({service_account_dir} and ${SERVICE_HOST_ENV}/${SERVICE_PORT_ENV}), or create {home}"
    )


def load_configuration(
    kubeconfig: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] = os.environ,
    service_account_dir: Path = SERVICE_ACCOUNT_DIR,
    home_kubeconfig: Path = HOME_KUBECONFIG,
) -> k8s.Configuration:
    """A fresh client Configuration from the source `resolve` picks (never the library's process-wide default)."""
    source = resolve(
        kubeconfig, environ=environ, service_account_dir=service_account_dir, home_kubeconfig=home_kubeconfig
    )
    configuration = k8s.Configuration()
    try:
        if source.origin == "in-cluster":
            InClusterConfigLoader(  # type: ignore[no-untyped-call]
                token_filename=str(service_account_dir / "token"),
                cert_filename=str(service_account_dir / "ca.crt"),
                environ=environ,
            ).load_and_set(configuration)
        else:
            # An explicit path is passed as is: the library's own default reads $KUBECONFIG once, at import time.
            k8s_config.load_kube_config(config_file=source.path, client_configuration=configuration)  # type: ignore[no-untyped-call]
    except (k8s_config.ConfigException, OSError, ValueError) as exc:
        raise KubeConfigError(f"Failed to load {source.describe()}: {exc}") from exc
    return configuration


def new_api_client(
    kubeconfig: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] = os.environ,
    pool_size: int | None = None,
) -> k8s.ApiClient:
    """An ApiClient configured by `load_configuration`; `pool_size` widens urllib3's connection pool for callers
    that share one client across many threads."""
    configuration = load_configuration(kubeconfig, environ=environ)
    if pool_size is not None:
        configuration.connection_pool_maxsize = pool_size
    return k8s.ApiClient(configuration)
