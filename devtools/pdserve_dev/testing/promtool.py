"""Run promtool (built with the local cluster's Prometheus) on rule files: `check rules` and `test rules` offline.

Built on first use when missing, like helm in `pdserve_dev.testing.helm`; cached afterwards.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from pdserve_dev.cluster import build


def promtool(*args: str, cwd: Path | None = None, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """Run promtool with `args` (never raises on a non-zero exit: the caller asserts on it with the output)."""
    binary = build.ensure_binaries(("promtool",)) / "promtool"
    return subprocess.run([str(binary), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
