"""Node folders an administrator allows, as the administrator types them: `pdserve operator` and `pdserve
validate` / `render` as subprocesses (issue 18.10). A prefix that is, lies in or holds a system folder (`/var`
holds `/var/lib/kubelet`, `/opt` holds `/opt/cni`) stops the command before anything runs, naming what it holds;
a PDService naming a distribution's or a network plugin's state is refused whatever the policy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def pdserve(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *args],
        cwd=ROOT,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def manifest(uri: str) -> str:
    document = yaml.safe_load((ROOT / "examples" / "minimal.yaml").read_text())
    document["spec"]["model"]["uri"] = uri
    return yaml.safe_dump(document)


@pytest.mark.parametrize(
    ("prefix", "named"),
    [
        ("/var", "/var/lib/calico"),
        ("/var/lib", "/var/lib/calico"),
        ("/opt", "/opt/cni"),
        ("/var/lib/rancher/k3s", "/var/lib/rancher"),
        ("/var/lib/kubernetes", "/var/lib/kubernetes"),
        ("/opt/cni/bin", "/opt/cni"),
    ],
)
def test_operator_refuses_a_prefix_that_holds_or_is_a_system_folder(prefix: str, named: str) -> None:
    """The operator exits with a usage error (2) before it connects to anything: no kubeconfig is needed."""
    result = pdserve(
        "operator", "--all-namespaces", "--allow-model-host-paths", "/mnt/models", "--allow-model-host-paths", prefix
    )
    assert result.returncode == 2, result.stderr
    assert f"'{prefix}'" in result.stderr and named in result.stderr, result.stderr


@pytest.mark.parametrize("command", ["validate", "render"])
def test_validate_and_render_refuse_the_same_prefixes(command: str) -> None:
    result = pdserve(command, "--allow-model-host-paths", "/var", "-f", "-", stdin=manifest("/var/lib/models/llama"))
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert "contains the system folders" in result.stderr, result.stderr


@pytest.mark.parametrize("uri", ["/var/lib/rancher/k3s", "/var/lib/kubernetes/pki", "/opt/cni/bin"])
def test_a_pdservice_naming_system_state_is_refused(uri: str) -> None:
    result = pdserve("validate", "--allow-model-host-paths", "/mnt/models", "-f", "-", stdin=manifest(uri))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "spec.model.uri" in result.stdout + result.stderr and "system folder" in result.stdout + result.stderr


def test_dedicated_folders_beside_system_state_are_fine() -> None:
    for prefix in ("/var/lib/models", "/opt/models"):
        result = pdserve("validate", "--allow-model-host-paths", prefix, "-f", "-", stdin=manifest(f"{prefix}/llama"))
        assert result.returncode == 0, result.stdout + result.stderr
        rendered = pdserve("render", "--allow-model-host-paths", prefix, "-f", "-", stdin=manifest(f"{prefix}/llama"))
        assert f"path: {prefix}/llama" in rendered.stdout, rendered.stderr
