"""The `realvllm` tier: every test here runs real vLLM (PyPI's CPU build, installed by `scripts/install.sh` under
the project's cache folder). A missing install fails these tests with the command that installs it; `-m "not
realvllm"` leaves the tier out (each module carries the `realvllm` marker)."""

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
