"""The CLI's answers when no cluster runs (no binaries needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from pdserve_dev.cli import dev


def test_status_of_a_missing_cluster_exits_1(tmp_path: Path) -> None:
    result = CliRunner().invoke(dev, ["cluster", "status", "--workdir", str(tmp_path), "--json"])
    assert result.exit_code == 1
    assert json.loads(result.output)["running"] is False


def test_kubeconfig_and_env_of_a_missing_cluster_say_how_to_start_one(tmp_path: Path) -> None:
    for command in ("kubeconfig", "env"):
        result = CliRunner().invoke(dev, ["cluster", command, "--workdir", str(tmp_path)])
        assert result.exit_code == 1
        assert "pdserve dev cluster up" in result.output


def test_down_without_a_cluster_is_a_no_op(tmp_path: Path) -> None:
    result = CliRunner().invoke(dev, ["cluster", "down", "--workdir", str(tmp_path)])
    assert result.exit_code == 0
    assert "Nothing was running" in result.output


def test_up_rejects_an_unknown_topology(tmp_path: Path) -> None:
    result = CliRunner().invoke(dev, ["cluster", "up", "--workdir", str(tmp_path), "--topology", "huge"])
    assert result.exit_code == 2
    assert "huge" in result.output


def test_demo_without_a_chart_says_what_to_do(tmp_path: Path) -> None:
    """The demo installs pdserve with the checkout's chart; without one it stops before starting anything, and
    says so (from the namespace of its own it runs in, when it can make one) with the exit status passed on."""
    result = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "dev", "demo", "--keep"],
        env={**os.environ, "PDSERVE_CHART": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"Error: No Helm chart at {tmp_path}: run the demo from a pdserve checkout or set $PDSERVE_CHART" in (
        result.stdout
    )
    assert "Kept running" not in result.stdout
