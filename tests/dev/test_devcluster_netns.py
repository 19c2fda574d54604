"""Network namespaces: the test session is isolated, and a fresh namespace holds nothing but loopback."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pdserve_dev.cluster import netns

ONLY_LOOPBACK = "import socket, sys; sys.exit(0 if [n for _, n in socket.if_nameindex()] == ['lo'] else 3)"


@pytest.mark.skipif(not netns.can_isolate(), reason="no privilege to create network namespaces")
def test_session_runs_isolated() -> None:
    # tests/conftest.py moved the session into a loopback-only namespace before any test ran.
    assert netns.loopback_only()
    assert not netns.should_isolate()


@pytest.mark.skipif(not netns.can_isolate(), reason="no privilege to create network namespaces")
def test_fresh_namespace_has_only_loopback_and_passes_exit_codes() -> None:
    assert netns.run_in_fresh([sys.executable, "-c", ONLY_LOOPBACK]) == 0
    assert netns.run_in_fresh([sys.executable, "-c", "raise SystemExit(7)"]) == 7


def test_named_namespace_is_stable_per_workdir(tmp_path: Path) -> None:
    first = netns.named_namespace(tmp_path / "a")
    assert first == netns.named_namespace(tmp_path / "a")
    assert first != netns.named_namespace(tmp_path / "b")
    assert first.startswith("pdserve-") and len(first) <= 32
