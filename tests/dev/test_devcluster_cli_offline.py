"""The CLI's answers when no cluster runs (no binaries needed)."""

from __future__ import annotations

import json
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
