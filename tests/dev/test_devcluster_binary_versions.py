"""The binaries the local cluster builds behave as a user's released ones do: they report their release versions,
and helm assumes the Kubernetes version its release assumes, so `helm template charts/pdserve` works as is.

helm is built on first use (a few minutes cold, like the chart tests' helm); the other binaries are the cluster's
(the `cluster` marker has the session build them).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pdserve_dev.cluster import build, versions
from pdserve_dev.testing.helm import helm

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "pdserve"


def _run(binary: str, *args: str) -> str:
    proc = subprocess.run([str(build.binary(binary)), *args], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout + proc.stderr


def test_helm_template_renders_the_chart_as_a_users_helm_does() -> None:
    # No --kube-version: helm's default (stamped from its client-go, v1.37) meets the chart's kubeVersion >=1.29.
    proc = helm("template", "pdserve", str(CHART), "--namespace", "pdserve-system", check=False)
    assert proc.returncode == 0, proc.stderr
    kinds = {doc["kind"] for doc in yaml.safe_load_all(proc.stdout) if doc}
    assert {"Deployment", "CustomResourceDefinition", "ServiceAccount"} <= kinds
    # The chart's constraint is still checked: an older cluster is refused with helm's own message.
    old = helm("template", "pdserve", str(CHART), "--kube-version", "1.28.0", check=False)
    assert old.returncode != 0 and "requires kubeVersion: >=1.29.0-0" in old.stderr, old.stderr
    assert helm("lint", "--strict", str(CHART), check=False).returncode == 0


def test_helm_version_reports_the_release_and_assumes_its_kubernetes(tmp_path: Path) -> None:
    out = helm("version").stdout
    assert f'Version:"{versions.HELM_VERSION}"' in out and 'GitTreeState:"clean"' in out, out
    assert helm("version", "--template", "{{.Version}}").stdout == versions.HELM_VERSION
    # What a chart sees without a cluster: the Kubernetes release of helm's client-go (v1.20 unstamped).
    chart = tmp_path / "probe"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: probe\nversion: 0.1.0\n")
    (chart / "templates" / "kube.yaml").write_text("kube: {{ .Capabilities.KubeVersion.Version }}\n")
    rendered = yaml.safe_load(helm("template", "probe", str(chart)).stdout.split("---", 2)[-1])
    assert rendered == {"kube": "v1.37.0"}


@pytest.mark.cluster
def test_the_cluster_binaries_report_their_release_versions() -> None:
    assert f"Client Version: {versions.KUBERNETES_VERSION}" in _run("kubectl", "version", "--client")
    assert f"Kubernetes {versions.KUBERNETES_VERSION}" in _run("kube-apiserver", "--version")
    assert f"Kubernetes {versions.KUBERNETES_VERSION}" in _run("kube-controller-manager", "--version")
    assert f"Kubernetes {versions.KUBERNETES_VERSION}" in _run("kube-scheduler", "--version")
    assert f"etcd Version: {versions.ETCD_VERSION.lstrip('v')}" in _run("etcd", "--version")
    assert versions.KWOK_VERSION in _run("kwok", "--version")
    assert f"prometheus, version {versions.PROMETHEUS_VERSION.lstrip('v')}" in _run("prometheus", "--version")


@pytest.mark.cluster
@pytest.mark.skipif(shutil.which("go") is None, reason="needs the Go toolchain")
def test_a_helm_that_builds_with_another_client_go_than_its_pin_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Offline: the module cache the cluster build filled, read with the proxy off; binaries go to a fresh cache root.
    modules = build.cache_root() / "go" / "mod"
    if not (modules / "helm.sh" / "helm" / f"v3@{versions.HELM_VERSION}").is_dir():
        pytest.skip("helm's modules are not in the module cache yet")
    (tmp_path / "go").mkdir()
    (tmp_path / "go" / "mod").symlink_to(modules)
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("GOPROXY", "off")
    monkeypatch.setenv("GOFLAGS", os.environ.get("GOFLAGS", ""))
    monkeypatch.setattr(versions, "HELM_CLIENT_GO_VERSION", "v0.36.0")
    report = build.build(["helm"], log=lambda _: None)
    (failure,) = report.failed
    assert failure.error is not None
    assert "builds with k8s.io/client-go v0.37.0" in failure.error and "pin v0.36.0" in failure.error, failure.error
    assert not (build.bin_dir() / "helm").exists()
