"""Pinned versions of every binary the local cluster runs: the one place to change them.

The binaries come in two toolsets, each cached under its own key: `k8s` (the cluster: Kubernetes, etcd, kwok,
helm) and `prometheus` (prometheus and promtool, which tests, the demo and the autoscaler's benchmark query). A
toolset's cache key is derived from its pins and its Go module templates in `gomod/`, so bumping a version here
(or editing a template) rebuilds that toolset and nothing else: a Prometheus bump never costs the 12-minute
Kubernetes build, and adding Prometheus did not invalidate Kubernetes binaries built before it existed.
Kubernetes' staging modules (k8s.io/api, k8s.io/client-go, ...) are published as v0.<minor>.<patch> for
Kubernetes v1.<minor>.<patch>; `staging_version()` derives that so the two can never disagree. Prometheus
publishes v3.<minor>.<patch> as the Go module version v0.3<minor>.<patch>; `prometheus_module_version()`
derives that.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
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

HELM_CLIENT_GO_VERSION = "v0.37.0"
"""The k8s.io/client-go that helm's go.mod requires. helm's release build (its Makefile) stamps the Kubernetes version
helm assumes without a cluster (`helm template`'s `.Capabilities.KubeVersion`, which charts' `kubeVersion` is checked
against, and `helm lint`'s deprecation checks) from it: v0.37 -> v1.37. Unstamped, helm assumes v1.20. The build
checks this pin against what `go list -m` resolves for helm, and a test checks it against helm's go.sum."""

PROMETHEUS_VERSION = "v3.16.0"
"""prometheus and promtool (module github.com/prometheus/prometheus, published as v0.316.0)."""

PROMETHEUS_BUILD_TAGS: tuple[str, ...] = ("remove_all_sd", "enable_kubernetes_sd")
"""Leave out every service discovery but Kubernetes (file and HTTP discovery are always in): Prometheus' own
build tags for slim builds. The cloud providers' SDKs would double the build time and the download for nothing."""

# Check tools (`tools.py`), built or fetched from the Go module proxy under a cache key of their own, so changing
# them never rebuilds the cluster's binaries.
CLI_UTILS_VERSION = "v0.37.2"
"""sigs.k8s.io/cli-utils, whose pkg/kstatus computes the health Flux and kpt read from conditions."""

PROMETHEUS_OPERATOR_VERSION = "v0.85.0"
"""github.com/prometheus-operator/prometheus-operator, whose module carries the monitoring.coreos.com CRDs."""

PROMETHEUS_OPERATOR_SUM = "h1:M5xLCLEoaW2IJfnuCwFzzpL+jSVQu3KGT84Pye+fW8s="
"""The module's go.sum hash: the CRDs are checked against it as well as against the checksum database."""

INFERENCE_EXTENSION_VERSION = "v1.6.0"
"""sigs.k8s.io/gateway-api-inference-extension: the InferencePool CRD and the reference endpoint picker (lwepp).
The module proxy refuses its version list: the version must be asked for by name."""

INFERENCE_EXTENSION_SUM = "h1:cjtwMJYcTnLXBYE5ffR1/hHhn7U1aIFfe2RITYmOXVA="
"""The module's go.sum hash (the CRD is checked against it as well as against the checksum database)."""

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
    """One Go main module built in its own directory, so the projects' dependency graphs never mix."""

    name: str
    """Directory under `gomod/` holding `go.mod.tmpl`."""
    binaries: dict[str, str]
    """Output binary name -> Go package path of its `main` package."""
    tags: tuple[str, ...] = ()
    """Go build tags."""


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

PROMETHEUS_MODULES: tuple[GoModule, ...] = (
    GoModule(
        "prometheus",
        {
            "prometheus": "github.com/prometheus/prometheus/cmd/prometheus",
            "promtool": "github.com/prometheus/prometheus/cmd/promtool",
        },
        tags=PROMETHEUS_BUILD_TAGS,
    ),
)


def _kubernetes_of_client_go(client_go_version: str) -> tuple[str, str]:
    """(major, minor) of the Kubernetes release a client-go version belongs to, as helm's Makefile derives them:
    v0.37.0 -> ("1", "37")."""
    parts = client_go_version.lstrip("v").split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"Expected a client-go version like v0.37.0, got {client_go_version!r}")
    return str(int(parts[0]) + 1), parts[1]


def ldflags(module: str) -> tuple[str, ...]:
    """The linker flags each project's release build passes (part of every cache key: a change rebuilds).

    `-s -w` strips symbols (binaries shrink by about a third); each `-X` stamps what the project's own release
    tooling stamps, so the binaries report and assume what a user's do:
    - Kubernetes (hack/lib/version.sh): gitVersion/gitMajor/gitMinor/gitTreeState in component-base and client-go.
      Unstamped, kube-apiserver reports v0.0.0-master at /version, which kubectl flags as version skew.
    - kwok (hack/releases.sh): its version.
    - helm (Makefile): its version and tree state, and the default Kubernetes version of `helm template` and `helm
      lint` from the client-go it is built with (`HELM_CLIENT_GO_VERSION`).
    - Prometheus (.promu.yml): version, branch and build user of `prometheus_build_info` and `--version`.
    Left out: git commits and build dates (the module proxy carries neither); etcd's version is a constant in its
    source (its release stamps only the commit).
    """
    flags = ["-s", "-w"]
    if module == "kubernetes":
        major, minor = KUBERNETES_VERSION.lstrip("v").split(".")[:2]
        for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
            flags += [
                f"-X {pkg}.gitVersion={KUBERNETES_VERSION}",
                f"-X {pkg}.gitMajor={major}",
                f"-X {pkg}.gitMinor={minor}",
                f"-X {pkg}.gitTreeState=clean",
            ]
    elif module == "kwok":
        flags.append(f"-X sigs.k8s.io/kwok/pkg/consts.Version={KWOK_VERSION}")
    elif module == "helm":
        major, minor = _kubernetes_of_client_go(HELM_CLIENT_GO_VERSION)
        flags += [
            f"-X helm.sh/helm/v3/internal/version.version={HELM_VERSION}",
            "-X helm.sh/helm/v3/internal/version.gitTreeState=clean",
        ]
        for pkg in ("helm.sh/helm/v3/pkg/chartutil", "helm.sh/helm/v3/pkg/lint/rules"):
            flags += [f"-X {pkg}.k8sVersionMajor={major}", f"-X {pkg}.k8sVersionMinor={minor}"]
    elif module == "prometheus":
        stamp = "github.com/prometheus/common/version"
        flags += [
            f"-X {stamp}.Version={PROMETHEUS_VERSION.lstrip('v')}",
            f"-X {stamp}.Branch=v{PROMETHEUS_VERSION.lstrip('v')}",
            f"-X {stamp}.BuildUser=pdserve-dev",
        ]
    return tuple(flags)


RESOLVED_PINS: dict[str, dict[str, Callable[[], str]]] = {
    "helm": {"k8s.io/client-go": lambda: HELM_CLIENT_GO_VERSION},
}
"""Per Go module directory: dependency versions the ldflags are derived from, which the build checks against what
`go list -m` resolves before building (a bump of helm that changes its client-go fails with the pin to update,
instead of stamping a wrong Kubernetes version)."""


def staging_version(kubernetes_version: str = KUBERNETES_VERSION) -> str:
    """Map v1.<minor>.<patch> to the staging modules' v0.<minor>.<patch>."""
    major, _, rest = kubernetes_version.lstrip("v").partition(".")
    if major != "1" or not rest:
        raise ValueError(f"Expected a Kubernetes version like v1.37.2, got {kubernetes_version!r}")
    return f"v0.{rest}"


def prometheus_module_version(prometheus_version: str | None = None) -> str:
    """Map Prometheus v3.<minor>.<patch> to its Go module version v0.3<minor>.<patch> (v3.16.0 -> v0.316.0)."""
    version = prometheus_version or PROMETHEUS_VERSION
    parts = version.lstrip("v").split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts) or int(parts[0]) < 2 or int(parts[1]) >= 100:
        raise ValueError(f"Expected a Prometheus version like v3.16.0, got {version!r}")
    major, minor, patch = (int(p) for p in parts)
    return f"v0.{major * 100 + minor}.{patch}"


def template_values() -> dict[str, str]:
    """Values substituted into the `gomod/*/go.mod.tmpl` templates of the cluster toolset (`${name}` syntax)."""
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


def prometheus_template_values() -> dict[str, str]:
    """Values substituted into `gomod/prometheus/go.mod.tmpl`."""
    return {"prometheus_version": PROMETHEUS_VERSION, "prometheus_module_version": prometheus_module_version()}


@dataclass(frozen=True)
class Toolset:
    """Go modules built and cached together under `<cache root>/<name>/<cache key>/bin`."""

    name: str
    """Directory under the cache root."""
    modules: tuple[GoModule, ...]
    values: Callable[[], dict[str, str]]
    """Template values (functions, so a pin changed at run time, as tests do, changes the key)."""
    version: Callable[[], str]
    """The readable prefix of the cache key."""

    @property
    def binaries(self) -> tuple[str, ...]:
        return tuple(name for module in self.modules for name in module.binaries)


KUBERNETES = Toolset("k8s", GO_MODULES, template_values, lambda: KUBERNETES_VERSION)
"""The cluster: Kubernetes, etcd, kwok, helm."""

PROMETHEUS = Toolset("prometheus", PROMETHEUS_MODULES, prometheus_template_values, lambda: PROMETHEUS_VERSION)
"""The metrics server tests and the demo scrape engines and routers with."""

TOOLSETS: tuple[Toolset, ...] = (KUBERNETES, PROMETHEUS)

ALL_BINARIES: tuple[str, ...] = tuple(name for toolset in TOOLSETS for name in toolset.binaries)


def toolset_of(binary: str) -> Toolset:
    """The toolset that builds `binary`; KeyError for an unknown name."""
    for toolset in TOOLSETS:
        if binary in toolset.binaries:
            return toolset
    raise KeyError(binary)


def read_template(module: str) -> str:
    """The raw go.mod template of one module directory."""
    return resources.files("pdserve_dev.cluster").joinpath("gomod").joinpath(module).joinpath("go.mod.tmpl").read_text()


def read_go_sum(module: str) -> str:
    """The checked-in go.sum of one module directory ('' when there is none)."""
    path = resources.files("pdserve_dev.cluster").joinpath("gomod").joinpath(module).joinpath("go.sum")
    return path.read_text() if path.is_file() else ""


def cache_key(toolset: Toolset = KUBERNETES) -> str:
    """A directory name that changes exactly when a pin, a template or the build recipe of `toolset` changes.

    Readable prefix (the toolset's version) for humans, then a short hash over every pin and template so two
    checkouts with different pins never share a binary directory.
    """
    digest = hashlib.sha256()
    for key, value in sorted(toolset.values().items()):
        digest.update(f"{key}={value}\n".encode())
    for module in toolset.modules:
        digest.update(read_template(module.name).encode())
        for binary, package in sorted(module.binaries.items()):
            digest.update(f"{binary}={package}\n".encode())
        # Hashed only when set, so the toolsets without tags keep the key they had before tags existed.
        if module.tags:
            digest.update(f"tags={','.join(module.tags)}\n".encode())
        # The linker flags stamp versions into the binaries: binaries built with other stamps are other binaries.
        digest.update(f"ldflags={' '.join(ldflags(module.name))}\n".encode())
    return f"{toolset.version()}-{digest.hexdigest()[:12]}"
