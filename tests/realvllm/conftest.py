"""The `realvllm` tier: every test here runs real vLLM (PyPI's CPU build, installed by `scripts/install.sh` under
the project's cache folder). A missing install fails these tests with the command that installs it; `-m "not
realvllm"` leaves the tier out (each module carries the `realvllm` marker).

Tests marked `realvllm_slow` (the lifecycle tests, several engine start-ups: about 7 minutes on two cores) run with
the rest, in `.ci/run` too; `-m "realvllm and not realvllm_slow"` leaves them out, `-m realvllm_slow` runs them alone.
They were deselected unless asked for while they took 20+ minutes: engines starting beside busy ones were starved by
two spinning loops, the process node's pod workers and vLLM's queues (docs/real-vllm.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve_dev.realvllm import install, models


@pytest.fixture(scope="session")
def real_vllm() -> Path:
    """The tiny model's HF_HOME; fails (does not skip) when real vLLM is not installed: CI must run the tier."""
    if not install.installed():
        pytest.fail(install.missing_message(), pytrace=False)
    return models.ensure_models()
