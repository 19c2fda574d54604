"""Pinned versions of every binary the local cluster runs: the one place to change them.

The cache key of the built binaries is derived from these pins and from the Go module templates in `gomod/`,
so bumping a version here (or editing a template) makes `pdserve dev cluster build` rebuild, and nothing else
does. Kubernetes' staging modules (k8s.io/api, k8s.io/client-go, ...) are published as v0.<minor>.<patch> for
Kubernetes v1.<minor>.<patch>; `staging_version()` derives that so the two can never disagree.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources

KUBERNETES_VERSION = "v1.37.2"
"""kube-apiserver, kube-controller-manager, kube-scheduler and kubectl (module k8s.io/kubernetes)."""

ETCD_VERSION = "v3.6.16"
"""etcd, the release line Kubernetes 1.37 is tested against (module go.etcd.io/etcd/server/v3)."""

KWOK_VERSION = "v0.8.0"
"""kwok, which fakes the kubelets of the simulated GPU nodes (module sigs.k8s.io/kwok)."""

HELM_VERSION = "v3.22.0"
"""helm, for rendering and installing the pdserve chart (module helm.sh/helm/v3)."""

# Every k8s.io module that k8s.io/kubernetes' go.mod replaces with ./staging/src/k8s.io/<name>. A module
# outside the main module cannot use those directory replacements, so our go.mod pins each one to the
# published tag instead. The list is the `replace` block of k8s.io/kubernetes v1.37's go.mod.
KUBERNETES_STAGING_MODULES: tuple[str, ...] = (
    "api",
    "apiextensions-apiserver",
    "apimachinery",
    "apiserver",
    "cli-runtime",
    "client-go",
    "cloud-provider",
    "cluster-bootstrap",
    "code-generator",
    "component-base",
    "component-helpers",
    "controller-manager",
    "cri-api",
    "cri-client",
    "cri-streaming",
    "csi-translation-lib",
    "dynamic-resource-allocation",
    "endpointslice",
    "externaljwt",
    "kms",
    "kube-aggregator",
    "kube-controller-manager",
    "kube-proxy",
    "kube-scheduler",
    "kubectl",
    "kubelet",
    "metrics",
    "mount-utils",
    "pod-security-admission",
    "sample-apiserver",
    "sample-cli-plugin",
    "sample-controller",
    "streaming",
)


@dataclass(frozen=True)
class GoModule:
    """One Go main module built in its own directory, so the four projects' dependency graphs never mix."""

    name: str
    """Directory under `gomod/` holding `go.mod.tmpl`."""
    binaries: dict[str, str]
    """Output binary name -> Go package path of its `main` package."""


GO_MODULES: tuple[GoModule, ...] = (
    GoModule(
        "kubernetes",
        {
            "kube-apiserver": "k8s.io/kubernetes/cmd/kube-apiserver",
            "kube-controller-manager": "k8s.io/kubernetes/cmd/kube-controller-manager",
            "kube-scheduler": "k8s.io/kubernetes/cmd/kube-scheduler",
            "kubectl": "k8s.io/kubernetes/cmd/kubectl",
        },
    ),
    GoModule("etcd", {"etcd": "go.etcd.io/etcd/server/v3"}),
    GoModule("kwok", {"kwok": "sigs.k8s.io/kwok/cmd/kwok"}),
    GoModule("helm", {"helm": "helm.sh/helm/v3/cmd/helm"}),
)

ALL_BINARIES: tuple[str, ...] = tuple(name for module in GO_MODULES for name in module.binaries)


def staging_version(kubernetes_version: str = KUBERNETES_VERSION) -> str:
    """Map v1.<minor>.<patch> to the staging modules' v0.<minor>.<patch>."""
    major, _, rest = kubernetes_version.lstrip("v").partition(".")
    if major != "1" or not rest:
        raise ValueError(f"Expected a Kubernetes version like v1.37.2, got {kubernetes_version!r}")
    return f"v0.{rest}"


def template_values() -> dict[str, str]:
    """Values substituted into the `gomod/*/go.mod.tmpl` templates (string.Template `${name}` syntax)."""
    staging = staging_version()
    replaces = "\n".join(f"\tk8s.io/{name} => k8s.io/{name} {staging}" for name in KUBERNETES_STAGING_MODULES)
    return {
        "kubernetes_version": KUBERNETES_VERSION,
        "staging_version": staging,
        "staging_replaces": replaces,
        "etcd_version": ETCD_VERSION,
        "kwok_version": KWOK_VERSION,
        "helm_version": HELM_VERSION,
    }


def read_template(module: str) -> str:
    """The raw go.mod template of one module directory."""
    return resources.files("pdserve_dev.cluster").joinpath("gomod").joinpath(module).joinpath("go.mod.tmpl").read_text()


def read_go_sum(module: str) -> str:
    """The checked-in go.sum of one module directory ('' when there is none)."""
    path = resources.files("pdserve_dev.cluster").joinpath("gomod").joinpath(module).joinpath("go.sum")
    return path.read_text() if path.is_file() else ""


def cache_key() -> str:
    """A directory name that changes exactly when a pin or a template changes.

    Readable prefix (the Kubernetes version) for humans, then a short hash over every pin and template so two
    checkouts with different pins never share a binary directory.
    """
    digest = hashlib.sha256()
    for key, value in sorted(template_values().items()):
        digest.update(f"{key}={value}\n".encode())
    for module in GO_MODULES:
        digest.update(read_template(module.name).encode())
        for binary, package in sorted(module.binaries.items()):
            digest.update(f"{binary}={package}\n".encode())
    return f"{KUBERNETES_VERSION}-{digest.hexdigest()[:12]}"
