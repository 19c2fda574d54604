"""kopf's login: the watches use the credentials pdserve.api.kubeclient loads, not kopf's own lookup order."""

from __future__ import annotations

from pathlib import Path

import yaml

from pdserve.api.kubeclient import load_configuration
from pdserve_operator.handlers import connection_info


def test_connection_info_carries_the_kubeconfig_server_and_token(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "https://api.example:6443"}}],
                "users": [{"name": "u", "user": {"token": "s3cret"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    # $KUBECONFIG names another cluster: the explicit file wins for kopf exactly as for the reconciler's client.
    info = connection_info(load_configuration(kubeconfig, environ={"KUBECONFIG": "/nonexistent"}))
    assert info.server == "https://api.example:6443"
    assert (info.scheme, info.token) == ("Bearer", "s3cret")
    assert info.insecure is False
