"""Golden files: `pdserve render` of every example equals tests/operator/render/golden/<example>.yaml.

Regenerate after an intended change with `PDSERVE_UPDATE_GOLDEN=1 pytest tests/operator/render` and review the diff.
A missing golden file is a failure, not a file to write: otherwise a renamed example would pass against itself.
The examples are rendered under the policy they are written for (`pdserve_dev.testing.examples`: node paths
under /mnt/models allowed).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from pdserve.api.validation import validate
from pdserve.cli.manifests import dump_stream
from pdserve_dev.testing.examples import POLICY
from pdserve_operator.render import render

ROOT = Path(__file__).resolve().parents[3]
GOLDEN = Path(__file__).resolve().parent / "golden"
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.yaml") if p.name != "invalid.yaml")


def rendered(example: Path) -> str:
    objects = []
    for doc in yaml.safe_load_all(example.read_text()):
        objects += render(validate(doc, POLICY))
    return dump_stream(objects)


def check_golden(text: str, golden: Path, *, update: bool) -> None:
    """Compare `text` with the golden file; write it instead only when asked to."""
    if update:
        golden.write_text(text)
    assert golden.exists(), f"{golden.name} is missing: run with PDSERVE_UPDATE_GOLDEN=1 and review the new file"
    assert text == golden.read_text(), f"render changed; see the diff and update {golden.name}"


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_render_matches_golden(example: Path) -> None:
    update = os.environ.get("PDSERVE_UPDATE_GOLDEN") == "1"
    check_golden(rendered(example), GOLDEN / f"{example.stem}.yaml", update=update)


def test_missing_golden_fails_without_update(tmp_path: Path) -> None:
    missing = tmp_path / "missing.yaml"
    with pytest.raises(AssertionError, match="missing"):
        check_golden("kind: X\n", missing, update=False)
    assert not missing.exists(), "a missing golden file was written without PDSERVE_UPDATE_GOLDEN=1"
    check_golden("kind: X\n", missing, update=True)
    assert missing.read_text() == "kind: X\n"
