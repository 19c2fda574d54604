"""The settings reference page, `docs/settings.md`, generated from the settings tables (`settings.py`).

    python -m pdserve.api.settings_doc > docs/settings.md

A test compares the checked-in page with this output, so the page cannot drift from the flags.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

from pydantic.alias_generators import to_camel

from pdserve.api.optioning import Setting, help_text, settings_of
from pdserve.api.settings import COMMANDS, shown_default

COMMAND = "python -m pdserve.api.settings_doc > docs/settings.md"

_INTRO = f"""# Process settings

<!-- Generated from pdserve/api/settings.py by `{COMMAND}`; do not edit by hand. -->

Every setting of the two long-running pdserve processes: the operator (`pdserve operator`, installed by the Helm
chart) and the PD router (`pdserve router`, which the operator runs for each PDService from a configuration file
it renders). Each is one line of `pdserve/api/settings.py`; the commands' `--help`, this page and the chart are
generated from or checked against it. What a PDService asks for is its spec, described by the CRD
(`kubectl explain pdservice.spec`), not here.
"""


def _value(value: Any) -> str:
    if value is None or value == ():
        return "none"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, str) and value == "":
        return '`""`'
    return f"`{value}`"


_METAVARS = {str: "TEXT", int: "INTEGER", float: "FLOAT"}


def _flag(row: Setting) -> str:
    """The flag as `--help` spells it: short aliases, `--on` / `--off`, the value's metavar or choices."""
    shorts = "".join(f"`{name}`, " for name in row.flags if not name.startswith("--"))
    if row.switch:
        negative = f" / `{row.negative_flag}`" if row.negative_flag is not None else ""
        return f"{shorts}`{row.flag}`{negative}"
    if row.choices:
        metavar = "[" + "\\|".join(row.choices) + "]"  # a pipe inside a table cell is escaped, even in code
    else:
        metavar = row.metavar or ("FILE" if row.file else _METAVARS[row.kind])
    repeat = " (repeatable)" if row.multiple else ""
    return f"{shorts}`{row.flag} {metavar}`{repeat}"


def _default(row: Setting) -> str:
    shown = shown_default(row)
    text = f"`{shown}`" if shown is not None else _value(row.default)
    if row.minimum is not None:
        text += f" (at least {row.minimum:g})"
    return text


def _chart(row: Setting) -> str:
    if row.chart is None:
        return "-"
    text = f"`{row.chart}`"
    if row.chart_value != row.default:
        text += f" (default {_value(row.chart_value)})"
    return text


def _help(row: Setting) -> str:
    text = help_text(row)
    if row.config is not None:
        field = ".".join(to_camel(part) for part in row.config.split("."))
        text += f" Overrides the configuration file's `{field}`."
    return text.replace("|", "\\|")


def reference_page() -> str:
    """The whole page (Markdown)."""
    parts = [_INTRO]
    for command, table in COMMANDS:
        parts.append(f"\n## `pdserve {command}`\n\n{inspect.cleandoc(table.__doc__ or '')}\n")
        parts.append("| Flag | Default | Helm chart value | Description |\n|---|---|---|---|")
        parts += [f"| {_flag(r)} | {_default(r)} | {_chart(r)} | {_help(r)} |" for r in settings_of(table)]
    return "\n".join(parts) + "\n"


def main() -> None:
    sys.stdout.write(reference_page())


if __name__ == "__main__":
    main()
