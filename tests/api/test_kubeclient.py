"""Kubernetes client configuration: the one precedence order (explicit, $KUBECONFIG, in-cluster, ~/.kube/config).

Each case lays out real files (kubeconfigs naming different API servers, a service-account directory with a token
and a CA) and loads them through the official client's loaders, then reads which server the configuration points
at. Nothing connects anywhere: a Configuration is only built.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from pdserve.api.kubeclient import KubeConfigError, load_configuration, new_api_client, resolve

IN_CLUSTER_ENV = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
IN_CLUSTER_HOST = "https://10.96.0.1:443"


def write_kubeconfig(path: Path, server: str, token: str = "t0ken") -> Path:
    document = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": server, "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "ctx",
    }
    path.write_text(yaml.safe_dump(document))
    return path


@pytest.fixture
def layout(tmp_path: Path) -> dict[str, Path]:
    """Every source present at once, each pointing at a different server."""
    service_account = tmp_path / "serviceaccount"
    service_account.mkdir()
    (service_account / "token").write_text("sa-token")
    (service_account / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    return {
        "explicit": write_kubeconfig(tmp_path / "explicit.yaml", "https://explicit.example:6443"),
        "env": write_kubeconfig(tmp_path / "env.yaml", "https://env.example:6443"),
        "home": write_kubeconfig(tmp_path / "home.yaml", "https://home.example:6443"),
        "service_account": service_account,
    }


def host(layout: dict[str, Path], kubeconfig: Path | None, environ: dict[str, str]) -> str:
    configuration = load_configuration(
        kubeconfig, environ=environ, service_account_dir=layout["service_account"], home_kubeconfig=layout["home"]
    )
    return str(configuration.host)


def test_explicit_kubeconfig_wins_over_everything(layout: dict[str, Path]) -> None:
    environ = {**IN_CLUSTER_ENV, "KUBECONFIG": str(layout["env"])}
    assert host(layout, layout["explicit"], environ) == "https://explicit.example:6443"


def test_kubeconfig_env_wins_over_in_cluster_and_home(layout: dict[str, Path]) -> None:
    environ = {**IN_CLUSTER_ENV, "KUBECONFIG": str(layout["env"])}
    assert host(layout, None, environ) == "https://env.example:6443"


def test_in_cluster_service_account_wins_over_home(layout: dict[str, Path]) -> None:
    configuration = load_configuration(
        None, environ=IN_CLUSTER_ENV, service_account_dir=layout["service_account"], home_kubeconfig=layout["home"]
    )
    assert configuration.host == IN_CLUSTER_HOST
    assert configuration.api_key["BearerToken"] == "bearer sa-token"
    assert configuration.ssl_ca_cert == str(layout["service_account"] / "ca.crt")


@pytest.mark.parametrize(
    "environ",
    [
        {"KUBERNETES_SERVICE_HOST": "10.96.0.1"},  # no port
        {"KUBERNETES_SERVICE_PORT": "443"},  # no host
        {"KUBERNETES_SERVICE_HOST": "", "KUBERNETES_SERVICE_PORT": "443"},
    ],
)
def test_in_cluster_needs_host_and_port(layout: dict[str, Path], environ: dict[str, str]) -> None:
    assert host(layout, None, environ) == "https://home.example:6443"


def test_in_cluster_needs_the_token(layout: dict[str, Path]) -> None:
    (layout["service_account"] / "token").unlink()
    assert host(layout, None, IN_CLUSTER_ENV) == "https://home.example:6443"


def test_an_empty_kubeconfig_variable_counts_as_unset(layout: dict[str, Path]) -> None:
    assert host(layout, None, {**IN_CLUSTER_ENV, "KUBECONFIG": ""}) == IN_CLUSTER_HOST


def test_kubeconfig_env_may_list_several_files(layout: dict[str, Path], tmp_path: Path) -> None:
    # kubectl's merge: the first file that sets current-context decides; later files add clusters and users.
    second = tmp_path / "second.yaml"
    second.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "Config", "clusters": [], "users": []}))
    environ = {"KUBECONFIG": os.pathsep.join([str(second), str(layout["env"])])}
    assert host(layout, None, environ) == "https://env.example:6443"


def test_a_chosen_source_that_fails_is_an_error_not_a_fall_through(layout: dict[str, Path], tmp_path: Path) -> None:
    # A typo in the flag or in $KUBECONFIG must not quietly talk to the in-cluster or home API server.
    missing = tmp_path / "missing.yaml"
    with pytest.raises(KubeConfigError, match=f"kubeconfig {missing}"):
        host(layout, missing, IN_CLUSTER_ENV)
    with pytest.raises(KubeConfigError, match=r"\$KUBECONFIG"):
        host(layout, None, {**IN_CLUSTER_ENV, "KUBECONFIG": str(missing)})
    (layout["service_account"] / "ca.crt").unlink()
    with pytest.raises(KubeConfigError, match="in-cluster service account"):
        host(layout, None, IN_CLUSTER_ENV)


def test_no_source_at_all_says_what_to_provide(tmp_path: Path) -> None:
    with pytest.raises(KubeConfigError, match="--kubeconfig") as caught:
        resolve(None, environ={}, service_account_dir=tmp_path / "none", home_kubeconfig=tmp_path / "absent")
    assert "KUBECONFIG" in str(caught.value) and "KUBERNETES_SERVICE_HOST" in str(caught.value)


def test_resolve_names_the_source(layout: dict[str, Path]) -> None:
    def origin(kubeconfig: Path | None, environ: dict[str, str]) -> str:
        found = resolve(
            kubeconfig, environ=environ, service_account_dir=layout["service_account"], home_kubeconfig=layout["home"]
        )
        return found.origin

    assert origin(layout["explicit"], {}) == "explicit"
    assert origin(None, {"KUBECONFIG": "x"}) == "KUBECONFIG"
    assert origin(None, IN_CLUSTER_ENV) == "in-cluster"
    assert origin(None, {}) == "home"


def test_new_api_client_sizes_the_connection_pool(layout: dict[str, Path]) -> None:
    with new_api_client(layout["explicit"], environ={}, pool_size=64) as api_client:
        assert api_client.configuration.host == "https://explicit.example:6443"
        assert api_client.configuration.connection_pool_maxsize == 64
