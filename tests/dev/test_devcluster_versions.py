"""Pinned versions -> generated go.mod files and the binary cache key (no Go needed)."""

from __future__ import annotations

import shutil
import string
from pathlib import Path

import pytest

from pdserve_dev.cluster import build, versions


def test_staging_version_follows_the_kubernetes_version() -> None:
    assert versions.staging_version("v1.37.2") == "v0.37.2"
    assert versions.staging_version("v1.36.3") == "v0.36.3"
    with pytest.raises(ValueError, match=r"v1\.37\.2"):
        versions.staging_version("v2.0.0")


def test_templates_render_completely() -> None:
    values = versions.template_values()
    for module in versions.GO_MODULES:
        text = string.Template(versions.read_template(module.name)).substitute(values)
        assert "${" not in text
        assert text.startswith("// ")
    kubernetes = string.Template(versions.read_template("kubernetes")).substitute(values)
    assert f"require k8s.io/kubernetes {versions.KUBERNETES_VERSION}" in kubernetes
    staging = versions.staging_version()
    for name in versions.KUBERNETES_STAGING_MODULES:
        assert f"\tk8s.io/{name} => k8s.io/{name} {staging}\n" in kubernetes


def test_cache_key_is_stable_and_changes_with_any_pin(monkeypatch: pytest.MonkeyPatch) -> None:
    key = versions.cache_key()
    assert key == versions.cache_key()
    assert key.startswith(versions.KUBERNETES_VERSION + "-")
    monkeypatch.setattr(versions, "ETCD_VERSION", "v3.6.15")
    assert versions.cache_key() != key
    monkeypatch.undo()
    monkeypatch.setattr(versions, "KUBERNETES_VERSION", "v1.36.3")
    assert versions.cache_key().startswith("v1.36.3-")


def test_cache_lives_under_pdserve_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    assert build.bin_dir() == build.cache_root() / "k8s" / versions.cache_key() / "bin"
    env = build.go_env()
    assert env["GOMODCACHE"] == f"{tmp_path}/go/mod"
    assert env["GOCACHE"] == f"{tmp_path}/go/build"
    assert "-mod=mod" in env["GOFLAGS"].split()
    assert build.missing_binaries() == list(versions.ALL_BINARIES)
    with pytest.raises(build.BuildError, match="pdserve dev cluster build"):
        build.binary("kubectl")


def test_missing_go_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(build.BuildError, match=r"Go toolchain \(`go`"):
        build.build()


def test_unknown_binary_is_refused() -> None:
    with pytest.raises(build.BuildError, match="Unknown binaries"):
        build.build(["kubelet"])


@pytest.mark.skipif(shutil.which("go") is None, reason="needs the Go toolchain")
def test_a_module_the_proxy_refuses_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # GOPROXY=off refuses every download deterministically, without touching the network.
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("GOPROXY", "off")
    report = build.build(["kwok"], log=lambda _: None)
    (failure,) = report.failed
    assert failure.name == "kwok"
    assert failure.error is not None
    assert "did not provide a module needed for kwok" in failure.error
    assert f"sigs.k8s.io/kwok {versions.KWOK_VERSION}" in failure.error
    assert not (build.bin_dir() / "kwok").exists()
    with pytest.raises(build.BuildError, match="kwok: the Go module proxy"):
        build.ensure_binaries(["kwok"], log=lambda _: None)


def test_the_cache_key_covers_the_linker_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    # A binary stamped with other versions is another binary: a recipe change must never reuse a cached one.
    key, prometheus = versions.cache_key(), versions.cache_key(versions.PROMETHEUS)
    monkeypatch.setattr(versions, "HELM_CLIENT_GO_VERSION", "v0.36.0")
    assert versions.cache_key() != key
    assert versions.cache_key(versions.PROMETHEUS) == prometheus
    original = versions.ldflags
    monkeypatch.setattr(versions, "ldflags", lambda module: (*original(module), "-X example.com/v.x=1"))
    assert versions.cache_key(versions.PROMETHEUS) != prometheus


def test_helm_is_stamped_as_its_release_stamps_it() -> None:
    flags = versions.ldflags("helm")
    assert f"-X helm.sh/helm/v3/internal/version.version={versions.HELM_VERSION}" in flags
    assert "-X helm.sh/helm/v3/internal/version.gitTreeState=clean" in flags
    # The default Kubernetes version of `helm template` / `helm lint` (v1.20 unstamped) follows helm's client-go.
    for pkg in ("helm.sh/helm/v3/pkg/chartutil", "helm.sh/helm/v3/pkg/lint/rules"):
        assert f"-X {pkg}.k8sVersionMajor=1" in flags
        assert f"-X {pkg}.k8sVersionMinor=37" in flags


def test_helms_client_go_pin_is_the_one_its_go_sum_holds() -> None:
    # go.sum's module-content lines ("<path> <version> h1:...", not ".../go.mod") are the versions built.
    built = {
        version
        for path, version, _ in (line.split() for line in versions.read_go_sum("helm").splitlines() if line.strip())
        if path == "k8s.io/client-go" and not version.endswith("/go.mod")
    }
    assert built == {versions.HELM_CLIENT_GO_VERSION}
    (pin,) = versions.RESOLVED_PINS["helm"].values()
    assert pin() == versions.HELM_CLIENT_GO_VERSION


def test_a_client_go_version_maps_to_its_kubernetes_release() -> None:
    assert versions._kubernetes_of_client_go("v0.37.0") == ("1", "37")
    assert versions._kubernetes_of_client_go("v0.38.2") == ("1", "38")
    with pytest.raises(ValueError, match="client-go"):
        versions._kubernetes_of_client_go("v1")
