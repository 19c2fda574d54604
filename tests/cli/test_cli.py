"""The CLI as users run it: `pdserve` as a subprocess."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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


def test_crd_prints_checked_in_file() -> None:
    result = pdserve("crd")
    assert result.returncode == 0, result.stderr
    assert result.stdout == (ROOT / "crds" / "pdservice.yaml").read_text()


def test_render_example() -> None:
    result = pdserve("render", "-f", "examples/pdservice.yaml")
    assert result.returncode == 0, result.stderr
    objects = [o for o in yaml.safe_load_all(result.stdout) if o]
    kinds = sorted({o["kind"] for o in objects})
    assert kinds == sorted(
        [
            "ServiceAccount",
            "Role",
            "RoleBinding",
            "ConfigMap",
            "Service",
            "StatefulSet",
            "PodDisruptionBudget",
            "Deployment",
        ]
    )
    assert {o["metadata"]["labels"]["pdserve.io/role"] for o in objects} == {"prefill", "decode", "router"}


def test_render_from_stdin() -> None:
    text = (ROOT / "examples" / "minimal.yaml").read_text()
    result = pdserve("render", "-f", "-", stdin=text)
    assert result.returncode == 0, result.stderr
    assert "qwen-decode" in result.stdout


def test_validate_accepts_examples() -> None:
    result = pdserve("validate", "-f", "examples/pdservice.yaml")
    assert result.returncode == 0
    assert "valid" in result.stdout


def test_validate_rejects_broken_spec_naming_fields() -> None:
    result = pdserve("validate", "-f", "examples/invalid.yaml")
    assert result.returncode == 1
    for field in ("spec.prefill.gpusPerPod", "spec.prefill.tensorParallelSize", "spec.engine.sideChannelPort"):
        assert field in result.stderr


def test_render_refuses_invalid_spec() -> None:
    result = pdserve("render", "-f", "examples/invalid.yaml")
    assert result.returncode == 1
    assert result.stdout == ""
    assert "spec.decode.autoscaling.minReplicas" in result.stderr


def test_bad_input_files(tmp_path: Path) -> None:
    missing = pdserve("validate", "-f", str(tmp_path / "nope.yaml"))
    assert missing.returncode != 0 and "cannot read" in missing.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text("spec: [unclosed")
    result = pdserve("validate", "-f", str(broken))
    assert result.returncode != 0 and "not valid YAML" in result.stderr
    other = tmp_path / "other.yaml"
    other.write_text("kind: ConfigMap\nmetadata: {name: x}\n")
    result = pdserve("render", "-f", str(other))
    assert result.returncode != 0 and "holds no PDService" in result.stderr
    assert "Traceback" not in result.stderr + broken.read_text()


def test_help_lists_commands() -> None:
    result = pdserve("--help")
    assert result.returncode == 0
    for command in ("crd", "render", "validate", "sim", "router", "operator", "dev"):
        assert command in result.stdout
