"""Golden files: `pdserve render` of every example equals tests/operator/render/golden/<example>.yaml.

Regenerate after an intended change with `PDSERVE_UPDATE_GOLDEN=1 pytest tests/operator/render` and review the diff.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from pdserve.api.validation import parse_or_raise
from pdserve.cli.manifests import dump_stream
from pdserve_operator.render import render

ROOT = Path(__file__).resolve().parents[3]
GOLDEN = Path(__file__).resolve().parent / "golden"
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.yaml") if p.name != "invalid.yaml")


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_render_matches_golden(example: Path) -> None:
    objects = []
    for doc in yaml.safe_load_all(example.read_text()):
        objects += render(parse_or_raise(doc))
    text = dump_stream(objects)
    golden = GOLDEN / f"{example.stem}.yaml"
    if os.environ.get("PDSERVE_UPDATE_GOLDEN") == "1" or not golden.exists():
        golden.write_text(text)
    assert text == golden.read_text(), f"render of {example.name} changed; see the diff and update the golden file"
