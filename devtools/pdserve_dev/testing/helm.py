"""Render and lint a Helm chart with the helm binary the local cluster build makes (`pdserve dev cluster build`).

`helm template` and `helm lint` work offline, so the chart's tests need no cluster. They run as a user's would:
helm is stamped the way its release stamps it (`versions.ldflags`), so without a cluster it assumes the Kubernetes
version of the client-go it was built with, as a released helm does.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from pdserve_dev.cluster import build


class HelmError(AssertionError):
    """helm exited non-zero; the message is helm's stderr (e.g. a template's `fail`)."""


def helm(
    *args: str, check: bool = True, timeout: float = 120.0, kubeconfig: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the built helm with `args` (against the cluster of `kubeconfig`, when given); raise HelmError with its
    stderr when `check` and it fails."""
    # Built on first use when missing (a few minutes cold), like the cluster's binaries; cached afterwards.
    binary = build.ensure_binaries(("helm",)) / "helm"
    flags = [f"--kubeconfig={kubeconfig}"] if kubeconfig is not None else []
    proc = subprocess.run([str(binary), *flags, *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise HelmError(f"helm {' '.join(args)} exited {proc.returncode}:\n{proc.stderr.strip()}")
    return proc


def _value_args(values_files: Sequence[Path | str], values: Mapping[str, Any] | None) -> list[str]:
    args = []
    for path in values_files:
        args += ["--values", str(path)]
    for key, value in (values or {}).items():
        # --set-json keeps types (lists, ints, booleans) exactly as given.
        args += ["--set-json", f"{key}={json.dumps(value)}"]
    return args


def template_text(
    chart: Path,
    *,
    values_files: Sequence[Path | str] = (),
    values: Mapping[str, Any] | None = None,
    release: str = "pdserve",
    namespace: str = "pdserve-system",
    show_only: Sequence[str] = (),
) -> str:
    """`helm template` output as text (a multi-document YAML stream)."""
    args = ["template", release, str(chart), "--namespace", namespace]
    for template in show_only:
        args += ["--show-only", template]
    return helm(*args, *_value_args(values_files, values)).stdout


def template(
    chart: Path,
    *,
    values_files: Sequence[Path | str] = (),
    values: Mapping[str, Any] | None = None,
    release: str = "pdserve",
    namespace: str = "pdserve-system",
) -> list[dict[str, Any]]:
    """The rendered objects, parsed (empty documents dropped)."""
    text = template_text(chart, values_files=values_files, values=values, release=release, namespace=namespace)
    return [doc for doc in yaml.safe_load_all(text) if doc]


def lint(
    chart: Path, *, values_files: Sequence[Path | str] = (), values: Mapping[str, Any] | None = None
) -> subprocess.CompletedProcess[str]:
    """`helm lint --strict` (warnings fail too); the caller checks returncode and output."""
    args = ["lint", "--strict", str(chart)]
    return helm(*args, *_value_args(values_files, values), check=False)
