"""Check tools from the Go module proxy, cached like the cluster's binaries: kstatus-check, the Prometheus
Operator CRDs, the Gateway API Inference Extension's InferencePool CRD and its reference endpoint picker (lwepp).

- `kstatus-check` is a ten-line Go program (`gomod/kstatus/main.go`) over sigs.k8s.io/cli-utils' kstatus, the
  library Flux and kpt use to decide whether an object is Current, InProgress or Failed. Tests feed it the
  statuses the operator computes, so the GitOps semantics are checked against the real rules.
- The monitoring.coreos.com CRDs (ServiceMonitor, PodMonitor, PrometheusRule) come from the Prometheus Operator's
  Go module (`example/prometheus-operator-crd/`), downloaded with `go mod download`, verified against the pinned
  go.sum hash, and copied out, so the chart's monitoring objects can be dry-run against the real schemas.

- The InferencePool CRD (inference.networking.k8s.io/v1) comes from sigs.k8s.io/gateway-api-inference-extension's
  module (`config/crd/bases/`), verified the same way; the same module's `cmd/lwepp` (the reference picker) is
  built from a small module that requires it (`gomod/lwepp/`), for the gateway path's differential tests.

Layout under the cache root, beside `k8s/` (build.py):

    tools/<key>/bin/kstatus-check
    tools/<key>/bin/lwepp
    tools/<key>/prometheus-operator-crds/monitoring.coreos.com_*.yaml
    tools/<key>/inference-extension-crds/inference.networking.k8s.io_inferencepools.yaml

The key covers the pins and the kstatus sources only, so a change here never rebuilds kube-apiserver, and a cluster
pin change never rebuilds these. The Go module and build caches are shared with build.py.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import string
import subprocess
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from pdserve_dev import relay
from pdserve_dev.cluster import build, versions

KSTATUS_BINARY = "kstatus-check"
PROMETHEUS_OPERATOR_MODULE = "github.com/prometheus-operator/prometheus-operator"
PROMETHEUS_OPERATOR_CRD_DIR = "example/prometheus-operator-crd"
PROMETHEUS_OPERATOR_CRDS: tuple[str, ...] = (
    "monitoring.coreos.com_servicemonitors.yaml",
    "monitoring.coreos.com_podmonitors.yaml",
    "monitoring.coreos.com_prometheusrules.yaml",
)
"""The kinds the chart renders (the other seven CRDs of the module are not needed to check it)."""

INFERENCE_EXTENSION_MODULE = "sigs.k8s.io/gateway-api-inference-extension"
INFERENCE_POOL_CRD = "config/crd/bases/inference.networking.k8s.io_inferencepools.yaml"
LWEPP_BINARY = "lwepp"

# go.sum is not part of the key (as in build.py): it only pins hashes of what the pins already name.
_KSTATUS_SOURCES = ("go.mod.tmpl", "main.go")
_LWEPP_SOURCES = ("go.mod.tmpl", "tools.go")


def _gomod_source(folder: str, name: str) -> str:
    path = resources.files("pdserve_dev.cluster").joinpath("gomod").joinpath(folder).joinpath(name)
    return path.read_text() if path.is_file() else ""


def _kstatus_source(name: str) -> str:
    return _gomod_source("kstatus", name)


def cache_key() -> str:
    """Changes exactly when a pin or a kstatus source changes."""
    digest = hashlib.sha256()
    pins = (
        versions.CLI_UTILS_VERSION,
        versions.PROMETHEUS_OPERATOR_VERSION,
        versions.PROMETHEUS_OPERATOR_SUM,
        versions.INFERENCE_EXTENSION_VERSION,
        versions.INFERENCE_EXTENSION_SUM,
    )
    for pin in pins:
        digest.update(f"{pin}\n".encode())
    for name in _KSTATUS_SOURCES:
        digest.update(_kstatus_source(name).encode())
    for name in _LWEPP_SOURCES:
        digest.update(_gomod_source("lwepp", name).encode())
    return f"tools-{digest.hexdigest()[:12]}"


def tools_dir() -> Path:
    return build.cache_root() / "tools" / cache_key()


def kstatus_binary(log: Callable[[str], None] = print) -> Path:
    """Path of kstatus-check, built on first use (about a minute cold; k8s.io packages come from the shared
    build cache when the cluster was built)."""
    src = tools_dir() / "src" / "kstatus"

    def prepare() -> None:
        src.mkdir(parents=True, exist_ok=True)
        template = string.Template(_kstatus_source("go.mod.tmpl"))
        (src / "go.mod").write_text(template.substitute(cli_utils_version=versions.CLI_UTILS_VERSION))
        (src / "main.go").write_text(_kstatus_source("main.go"))
        known_sums = _kstatus_source("go.sum")
        if known_sums:
            (src / "go.sum").write_text(known_sums)

    return build.go_binary(
        tools_dir() / "bin" / KSTATUS_BINARY,
        source=src,
        what=f"sigs.k8s.io/cli-utils {versions.CLI_UTILS_VERSION} kstatus",
        lock=tools_dir() / ".build.lock",
        prepare=prepare,
        log=log,
    )


def prometheus_operator_crds(log: Callable[[str], None] = print) -> list[Path]:
    """The ServiceMonitor, PodMonitor and PrometheusRule CRDs of the pinned Prometheus Operator."""
    out_dir = tools_dir() / "prometheus-operator-crds"
    paths = [out_dir / name for name in PROMETHEUS_OPERATOR_CRDS]
    if all(path.is_file() for path in paths):
        return paths
    module = f"{PROMETHEUS_OPERATOR_MODULE}@{versions.PROMETHEUS_OPERATOR_VERSION}"
    with build._locked(tools_dir() / ".build.lock"):
        log(f"  prometheus-operator CRDs  downloading {module} ...")
        source = _download(module, versions.PROMETHEUS_OPERATOR_SUM) / PROMETHEUS_OPERATOR_CRD_DIR
        out_dir.mkdir(parents=True, exist_ok=True)
        for path in paths:
            partial = path.with_name(f".{path.name}.partial")
            shutil.copyfile(source / path.name, partial)
            partial.chmod(0o644)  # the module cache is read-only; our copy need not be
            partial.replace(path)
    return paths


def _download(module: str, expected_sum: str) -> Path:
    """`go mod download` of one module at a version given by name; its directory, checked against `expected_sum`.
    `go mod download -json` reports a refusal inside the JSON (field Error) and exits non-zero."""
    go, _ = build.check_go()
    proc = subprocess.run(
        [str(go), "mod", "download", "-json", module],
        env=build.go_env(),
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    try:
        info = json.loads(proc.stdout or "{}")
    except ValueError:
        info = {}
    if proc.returncode != 0 or info.get("Error"):
        reason = info.get("Error") or proc.stderr.strip()
        raise build.BuildError(f"the Go module proxy did not provide {module}: {reason}")
    if info.get("Sum") != expected_sum:
        raise build.BuildError(f"{module} has hash {info.get('Sum')}, expected {expected_sum} (versions.py)")
    return Path(info["Dir"])


def inference_pool_crd(log: Callable[[str], None] = print) -> Path:
    """The InferencePool CRD (inference.networking.k8s.io/v1) of the pinned Gateway API Inference Extension."""
    path = tools_dir() / "inference-extension-crds" / Path(INFERENCE_POOL_CRD).name
    if path.is_file():
        return path
    module = f"{INFERENCE_EXTENSION_MODULE}@{versions.INFERENCE_EXTENSION_VERSION}"
    with build._locked(tools_dir() / ".build.lock"):
        if path.is_file():
            return path
        log(f"  InferencePool CRD         downloading {module} ...")
        source = _download(module, versions.INFERENCE_EXTENSION_SUM) / INFERENCE_POOL_CRD
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.partial")
        shutil.copyfile(source, partial)
        partial.chmod(0o644)  # the module cache is read-only; our copy need not be
        partial.replace(path)
    return path


def lwepp_binary(log: Callable[[str], None] = print) -> Path:
    """Path of lwepp, the extension's reference endpoint picker, built on first use (a few minutes cold)."""
    src = tools_dir() / "src" / "lwepp"

    def prepare() -> None:
        _download(
            f"{INFERENCE_EXTENSION_MODULE}@{versions.INFERENCE_EXTENSION_VERSION}", versions.INFERENCE_EXTENSION_SUM
        )
        src.mkdir(parents=True, exist_ok=True)
        template = string.Template(_gomod_source("lwepp", "go.mod.tmpl"))
        (src / "go.mod").write_text(
            template.substitute(inference_extension_version=versions.INFERENCE_EXTENSION_VERSION)
        )
        (src / "tools.go").write_text(_gomod_source("lwepp", "tools.go"))
        (src / "go.sum").write_text(_gomod_source("lwepp", "go.sum"))

    package = f"{INFERENCE_EXTENSION_MODULE}/cmd/lwepp"
    return build.go_binary(
        tools_dir() / "bin" / LWEPP_BINARY,
        source=src,
        what=f"{package} {versions.INFERENCE_EXTENSION_VERSION}",
        package=package,
        lock=tools_dir() / ".build.lock",
        prepare=prepare,
        log=log,
    )


def ensure_all(log: Callable[[str], None] = print) -> None:
    """Build or fetch every check tool that is not cached yet (what `pdserve dev cluster build` calls)."""
    kstatus_binary(log)
    prometheus_operator_crds(log)
    inference_pool_crd(log)
    lwepp_binary(log)
    relay.binary(log)  # the picker pods' relay container (the process node's image map names it)
