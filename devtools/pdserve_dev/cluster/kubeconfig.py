"""Kubeconfig files for the cluster's users, with certificates embedded so a file works when copied elsewhere."""

from __future__ import annotations

import base64
from pathlib import Path

import yaml

from pdserve_dev.cluster.certs import Pki

CONTEXT_NAME = "pdserve-dev"


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def render_kubeconfig(server: str, pki: Pki, client_stem: str, cluster_name: str = CONTEXT_NAME) -> dict[str, object]:
    """A kubeconfig dict for one client identity of `pki` talking to `server` (https://127.0.0.1:PORT)."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": cluster_name,
                "cluster": {"server": server, "certificate-authority-data": _b64(pki.ca_cert)},
            }
        ],
        "users": [
            {
                "name": client_stem,
                "user": {
                    "client-certificate-data": _b64(pki.client_cert(client_stem)),
                    "client-key-data": _b64(pki.client_key(client_stem)),
                },
            }
        ],
        "contexts": [{"name": cluster_name, "context": {"cluster": cluster_name, "user": client_stem}}],
        "current-context": cluster_name,
    }


def write_kubeconfig(path: Path, server: str, pki: Pki, client_stem: str) -> Path:
    """Write the kubeconfig of one client (mode 0600: it holds a private key) and return its path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(render_kubeconfig(server, pki, client_stem), sort_keys=False))
    path.chmod(0o600)
    return path
