"""`scripts/test.sh` runs the suite as two pytest lanes at once, each chosen by a marker expression: together they
must select every test exactly once, whatever markers a test carries (a test in neither lane would never run in CI,
one in both would run twice, on two clusters). Checked on the expressions the script holds, with pytest's own
expression evaluator, over every combination of the markers they name."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "test.sh"
KEYWORDS = {"and", "or", "not"}


def _lanes() -> dict[str, str]:
    return dict(re.findall(r'^(LANE_[A-Z_]+)="([^"]+)"$', SCRIPT.read_text(), re.MULTILINE))


class _Carries:
    """pytest's marker matcher for a test carrying exactly `markers`."""

    def __init__(self, markers: set[str]) -> None:
        self.markers = markers

    def __call__(self, name: str, /, **kwargs: str | int | bool | None) -> bool:
        return name in self.markers


def _markers(expression: str) -> set[str]:
    return set(re.findall(r"[A-Za-z_]+", expression)) - KEYWORDS


def test_the_script_runs_two_lanes_by_their_expressions() -> None:
    lanes = _lanes()
    assert set(lanes) == {"LANE_CLUSTER", "LANE_REST"}, lanes
    script = SCRIPT.read_text()
    for name in lanes:
        assert f'pytest_run -m "${name}"' in script, name


def test_the_lanes_select_every_test_exactly_once() -> None:
    expressions = _lanes()
    lanes = {name: Expression.compile(expression) for name, expression in expressions.items()}
    markers = sorted(set().union(*(_markers(expression) for expression in expressions.values())))
    assert "cluster" in markers
    for present in itertools.product((False, True), repeat=len(markers)):
        carried = {marker for marker, on in zip(markers, present, strict=True) if on}
        chosen = [name for name, lane in lanes.items() if lane.evaluate(_Carries(carried))]
        assert len(chosen) == 1, (sorted(carried), chosen)


def test_every_marker_a_lane_names_is_registered(pytestconfig: pytest.Config) -> None:
    registered = {line.split(":", 1)[0].strip() for line in pytestconfig.getini("markers")}
    for expression in _lanes().values():
        assert _markers(expression) <= registered, expression
