"""How a process setting is declared once and turned into a command-line option: the mechanism behind `settings.py`.

A settings table is a frozen dataclass; each field is declared with `setting(default, *flags, help=..., ...)`,
which keeps the dataclass default (so `OperatorSettings()` is every default, typed) and records the rest in the
field's metadata. `settings_of(table)` reads it back as `Setting` rows, with the type taken from the annotation:

- `int`, `float`, `str`: an option taking one value (`minimum`: the smallest value accepted; `file`: a path);
- `X | None` with default None: the same, optional;
- `bool`: a switch (`--flag`, or `--flag/--no-flag` when both spellings are given);
- `tuple[str, ...]`: a repeatable option;
- `Literal["a", "b"]`: a choice.

`click_options(table)` decorates a click command with one option per row, in table order, each named as its field,
so the command receives exactly the table's keyword arguments (`table(**values)` builds the settings).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, Final, Literal, TypeVar, get_args, get_origin, get_type_hints

import click

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

_KEY = "pdserve.setting"


class _Same:
    def __repr__(self) -> str:
        return "SAME"


SAME: Final[Any] = _Same()
"""`chart_default` when the chart's values.yaml holds the table's default."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """One process setting, as its table row says (see the module docstring)."""

    name: str
    flags: tuple[str, ...]
    help: str
    default: Any
    #: The value's type without None: int, float, str, bool or str for a repeatable or choice option.
    kind: type
    optional: bool
    multiple: bool
    choices: tuple[str, ...]
    minimum: float | None
    metavar: str | None
    file: Literal["existing", "any"] | None
    #: An environment variable whose value, when set, wins over the option.
    env: str | None
    #: Dotted path of the Helm chart value that sets it (None: the chart does not).
    chart: str | None
    #: What the chart's values.yaml holds by default, when it differs from `default` (the chart derives it).
    chart_default: Any
    #: Router only: the `RouterConfig` field (dotted, snake_case) this option overrides; its default is that field's.
    config: str | None

    @property
    def flag(self) -> str:
        """The long flag (`--workers`; `--leader-elect` of `--leader-elect/--no-leader-elect`)."""
        return next(f for f in self.flags if f.startswith("--")).split("/")[0]

    @property
    def negative_flag(self) -> str | None:
        """`--no-leader-elect` of `--leader-elect/--no-leader-elect`; None for other options."""
        long = next(f for f in self.flags if f.startswith("--"))
        return long.split("/")[1] if "/" in long else None

    @property
    def switch(self) -> bool:
        return self.kind is bool

    @property
    def chart_value(self) -> Any:
        """The chart's default for this setting (only meaningful when `chart` is set)."""
        return self.default if self.chart_default is SAME else self.chart_default


def setting(
    default: T,
    *flags: str,
    help: str,
    minimum: float | None = None,
    metavar: str | None = None,
    file: Literal["existing", "any"] | None = None,
    env: str | None = None,
    chart: str | None = None,
    chart_default: Any = SAME,
    config: str | None = None,
) -> T:
    """A settings-table field: its default, its flags (`--name`, short aliases, `--on/--off` for a switch) and the
    rest of its row (see `Setting`)."""
    if not flags or not flags[0].startswith("--"):
        raise TypeError(f"a setting needs its long flag first, got {flags!r}")
    row = {
        "flags": flags,
        "help": help,
        "minimum": minimum,
        "metavar": metavar,
        "file": file,
        "env": env,
        "chart": chart,
        "chart_default": chart_default,
        "config": config,
    }
    field: T = dataclasses.field(default=default, metadata={_KEY: row})
    return field


def settings_of(table: type[Any]) -> tuple[Setting, ...]:
    """The rows of a settings table, in declaration order."""
    hints = get_type_hints(table)
    rows = []
    for field in dataclasses.fields(table):
        row = field.metadata.get(_KEY)
        if row is None:
            raise TypeError(f"{table.__name__}.{field.name} is not declared with setting()")
        kind, optional, multiple, choices = _shape(hints[field.name], f"{table.__name__}.{field.name}")
        rows.append(Setting(name=field.name, default=field.default, kind=kind, optional=optional,
                            multiple=multiple, choices=choices, **row))  # fmt: skip
    return tuple(rows)


def _shape(annotation: Any, where: str) -> tuple[type, bool, bool, tuple[str, ...]]:
    """(kind, optional, multiple, choices) of a field's annotation."""
    optional = False
    args = get_args(annotation)
    if get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"{where}: one type or None, got {annotation!r}")
        annotation, optional = rest[0], True
    origin = get_origin(annotation)
    if origin is tuple and get_args(annotation)[1:] == (Ellipsis,) and get_args(annotation)[0] is str:
        return str, optional, True, ()
    if origin is Literal:
        return str, optional, False, tuple(str(a) for a in get_args(annotation))
    if annotation in (int, float, str, bool):
        return annotation, optional, False, ()
    raise TypeError(f"{where}: unsupported setting type {annotation!r}")


def help_text(row: Setting) -> str:
    """The row's help, with what overrides it (an environment variable) said once for `--help` and the docs."""
    return row.help if row.env is None else f"{row.help} ${row.env}, when set, wins."


def click_type(row: Setting) -> Any:
    """The click parameter type of a row."""
    if row.choices:
        return click.Choice(row.choices)
    if row.file is not None:
        return click.Path(exists=row.file == "existing", dir_okay=False)
    if row.minimum is not None and row.kind is int:
        return click.IntRange(min=int(row.minimum))
    if row.minimum is not None and row.kind is float:
        return click.FloatRange(min=row.minimum)
    return row.kind


def click_option(row: Setting, shown_default: str | None = None) -> Callable[[F], F]:
    """One row as a click option named after its field. `shown_default`: what `--help` says the default is when
    the option itself has none (a router flag whose default is its config field's)."""
    show: bool | str = shown_default if shown_default is not None else row.default not in (None, ())
    extra: dict[str, Any] = {}
    if row.switch:
        extra["is_flag"] = True
    else:
        extra["type"] = click_type(row)
    decorator: Callable[[F], F] = click.option(
        *row.flags,
        row.name,
        default=row.default,
        multiple=row.multiple,
        metavar=row.metavar,
        show_default=show,
        help=help_text(row),
        **extra,
    )
    return decorator


def click_options(
    rows: tuple[Setting, ...], shown: Callable[[Setting], str | None] = lambda row: None
) -> Callable[[F], F]:
    """Decorate a click command with one option per row, in table order (`shown`: see `click_option`)."""

    def decorate(command: F) -> F:
        for row in reversed(rows):  # click lists options in the order their decorators apply, innermost first
            command = click_option(row, shown(row))(command)
        return command

    return decorate
