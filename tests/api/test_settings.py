"""The one table of process settings against what users read and run: `--help` of each command (as a subprocess and
as click sees it), the reference page `docs/settings.md`, and the code below the composition root, which must not
carry a default of its own for any setting. (The Helm chart's side: tests/chart/test_chart_settings.py.)"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest

from pdserve.api.optioning import Setting, settings_of
from pdserve.api.settings import COMMANDS, OperatorSettings, shown_default
from pdserve.api.settings_doc import COMMAND, reference_page
from pdserve.cli import main

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "settings.md"
TABLES = dict(COMMANDS)


def help_entries(command: str) -> dict[str, str]:
    """`pdserve COMMAND --help` as a user runs it: each option's entry (flags, help, [default: ...]) by its long
    flag, with click's line wrapping undone."""
    result = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", command, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    entries: dict[str, str] = {}
    current = ""
    for line in result.stdout.split("Options:")[1].splitlines():
        if line.startswith("  -"):  # an option's first line; its continuation lines are indented further
            flag = re.search(r"--[a-z][a-z-]*", line)
            assert flag is not None, line
            current = flag.group()
            entries[current] = line.strip()
        elif current and line.strip():
            entries[current] += " " + line.strip()
    return entries


def squeezed(text: str) -> str:
    """`text` without whitespace: click wraps help text at spaces and after hyphens."""
    return re.sub(r"\s+", "", text)


def click_command(command: str) -> click.Command:
    found = main.get_command(click.Context(main), command)
    assert found is not None
    return found


def shown(value: Any) -> str | None:
    """How click shows a default in `--help` ([default: ...]), None when it shows none."""
    if value is None or value == () or value is False:
        return None
    return str(value)


def test_the_reference_page_is_current() -> None:
    assert PAGE.exists(), f"docs/settings.md is missing: run `{COMMAND}`"
    assert PAGE.read_text() == reference_page(), f"docs/settings.md is stale: run `{COMMAND}`"


def test_the_reference_page_lists_every_flag_with_its_default() -> None:
    page = PAGE.read_text()
    for command, table in COMMANDS:
        section = page.split(f"## `pdserve {command}`")[1].split("\n## ")[0]
        rows = [line for line in section.splitlines() if line.startswith("| `")]
        assert len(rows) == len(settings_of(table)), command
        for row, line in zip(settings_of(table), rows, strict=True):
            assert f"`{row.flag}" in line.split(" | ")[0], (row.name, line)
            default = shown_default(row) or (shown(row.default) if row.default is not True else "true")
            assert default is None or f"`{default}`" in line.split(" | ")[1], (row.name, line)
            assert (row.chart is None) == (line.split(" | ")[2] == "-"), (row.name, line)


@pytest.mark.parametrize("command", sorted(TABLES))
def test_every_flag_is_a_row_of_the_table(command: str) -> None:
    """What click parses is the table: the same names, flags, defaults and help, nothing more, nothing less."""
    rows = {row.name: row for row in settings_of(TABLES[command])}
    params = {p.name: p for p in click_command(command).params if isinstance(p, click.Option)}
    assert set(params) == set(rows)
    for name, option in params.items():
        row: Setting = rows[name]
        assert option.opts + option.secondary_opts == [f for spec in row.flags for f in spec.split("/")], name
        assert option.default == row.default, name
        assert option.multiple == row.multiple and option.is_flag == row.switch, name
        assert (option.help or "").startswith(row.help), name


@pytest.mark.parametrize("command", sorted(TABLES))
def test_help_shows_every_setting_with_its_default(command: str) -> None:
    entries = help_entries(command)
    rows = settings_of(TABLES[command])
    # Nothing in --help that the table does not have (click's own --help aside), and every row is there.
    assert set(entries) - {"--help"} == {row.flag for row in rows}
    for row in rows:
        entry = squeezed(entries[row.flag])
        assert squeezed(row.help) in entry, (row.name, entry)
        # A default the option takes from elsewhere (a router flag: its configuration file field) is shown as click
        # shows a described default: in parentheses.
        default = f"({shown_default(row)})" if shown_default(row) is not None else shown(row.default)
        if row.switch and row.negative_flag is not None and row.config is None:
            default = (row.flag if row.default else row.negative_flag).removeprefix("--")
        if default is not None:
            assert squeezed(f"[default: {default}") in entry, (row.name, entry)
        else:
            assert "[default:" not in entry, (row.name, entry)


@pytest.mark.parametrize(
    ("args", "flag", "bound"),
    [
        (("operator", "-A", "--autoscaler-interval-seconds", "0.1"), "--autoscaler-interval-seconds", "0.5"),
        (("router", "--decode", "http://d:1", "--engine-metrics-interval", "-1"), "--engine-metrics-interval", "0"),
    ],
)
def test_a_value_below_the_tables_bound_is_refused(args: tuple[str, ...], flag: str, bound: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 2, result.stderr
    assert flag in result.stderr and f">={bound}" in result.stderr


# -------------------------------------------------------------------------- no defaults below the root

# The composition roots, where the table's values are read and handed down; and the code below each, which is
# handed them. A setting without a value of its own (None, nothing given) has no default to repeat; a router flag
# overriding a configuration file field has its default there (`RouterConfig`), which the router reads.
ROOTS = {
    ROOT / "operator" / "pdserve_operator" / "cli.py",
    ROOT / "operator" / "pdserve_operator" / "runner.py",
    ROOT / "runtime" / "pdserve_runtime" / "router" / "cli.py",
}
BELOW = {"operator": ROOT / "operator", "router": ROOT / "runtime"}
# The names the operator's settings go by below the roots, where they differ from the table's.
ALIASES = {
    "crash_window": "crash_recovery_seconds",
    "interval_s": "autoscaler_interval_seconds",
    "window_s": "autoscaler_window_seconds (the interval)",
    "warmup_s": "spec.autoscaling.warmupSeconds",
    "deadline_s": "prometheus_timeout",
    "server_timeout": "watch_timeout",
    "client_timeout": "watch_timeout",
}


def defaulted(tree: ast.AST) -> list[tuple[str, int]]:
    """(name, line) of every parameter and dataclass field with a default."""
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args
            positional = [*args.posonlyargs, *args.args]
            found += [(a.arg, a.lineno) for a in positional[len(positional) - len(args.defaults) :]]
            found += [(a.arg, a.lineno) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d]
        elif isinstance(node, ast.ClassDef):
            found += [
                (item.target.id, item.lineno)
                for item in node.body
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value is not None
            ]
    return found


def defaults_below_the_root() -> list[str]:
    """`file:line name` of every parameter or dataclass field below a composition root that is named like one of
    its command's settings (which has a default of its own) and has a default."""
    found = []
    for command, table in COMMANDS:
        names = {r.name for r in settings_of(table) if r.default not in (None, ()) and r.config is None}
        if command == "operator":
            names |= set(ALIASES)
        for path in sorted(BELOW[command].rglob("*.py")):
            if path not in ROOTS:
                found += [
                    f"{path.relative_to(ROOT)}:{line} {name}"
                    for name, line in defaulted(ast.parse(path.read_text()))
                    if name in names
                ]
    return found


def test_nothing_below_the_composition_root_has_a_default_for_a_setting() -> None:
    assert defaults_below_the_root() == []


def test_the_table_is_typed_and_its_defaults_are_its_own() -> None:
    defaults = OperatorSettings()
    assert defaults.autoscaler_interval_seconds == OperatorSettings.autoscaler_interval_seconds == 15.0
    assert defaults.namespaces == () and defaults.prometheus_url is None and defaults.leader_elect is True
