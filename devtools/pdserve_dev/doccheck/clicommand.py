"""`pdserve ...` as the documentation shows it, parsed by the real click command tree.

Each group's and each command's own `make_context` parses its part of the line, exactly as `pdserve` would when
run: an unknown subcommand or option, an option without its value, a value outside a choice or a type, a missing
required option is click's own error. Nothing is invoked (`make_context` only parses; `--help` prints and stops).

Prose names commands loosely, so an inline code span (`complete=False`) may leave out a required option, stand for
a value with a placeholder (`-f FILE`, `--port N`) and list alternatives (`build|up|down`); a command in a fenced
block is what a user would paste, so it must parse as it is, placeholders aside.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Sequence

import click
from click.exceptions import Exit, MissingParameter, NoArgsIsHelpError

from pdserve_dev.doccheck.shell import is_placeholder

PROGRAM = "pdserve"


def check(root: click.Command, args: Sequence[str], *, complete: bool) -> list[str]:
    """What is wrong with `pdserve ARGS` (empty: it parses)."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return _check(root, PROGRAM, list(args), None, complete=complete)


def leaf(root: click.Command, args: Sequence[str]) -> list[str]:
    """The subcommand path `args` names (`["dev", "cluster", "up"]`), options skipped; for choosing what to run."""
    path: list[str] = []
    command = root
    context = click.Context(root, info_name=PROGRAM)
    for word in args:
        if not isinstance(command, click.Group) or word.startswith("-"):
            break
        found = command.get_command(context, word)
        if found is None:
            break
        path.append(word)
        command = found
    return path


def _check(
    command: click.Command, name: str, args: list[str], parent: click.Context | None, *, complete: bool
) -> list[str]:
    where = " ".join([*(parent.command_path.split() if parent else []), name])
    try:
        context = command.make_context(name, list(args), parent=parent)
    except Exit:
        return []  # --help or --version: printed and done
    except NoArgsIsHelpError:
        return [] if not complete else [f"`{where}` needs a subcommand"]
    except MissingParameter as exc:
        return [] if not complete else [f"`{where}`: {exc.format_message()}"]
    except click.BadParameter as exc:
        if any(is_placeholder(word) for word in args):
            return []  # a value the reader supplies (`--port N`) cannot be converted here
        return [f"`{where}`: {exc.format_message()}"]
    except click.BadOptionUsage as exc:
        # Prose names an option without its value (`--namespace`, repeatable); a pasted line may not.
        return [] if not complete else [f"`{where}`: {exc.format_message()}"]
    except click.UsageError as exc:
        return [f"`{where}`: {exc.format_message()}"]
    if not isinstance(command, click.Group):
        return []
    rest = [*context._protected_args, *context.args]
    if not rest:
        if command.invoke_without_command or not complete:
            return []
        return [f"`{where}` needs a subcommand"]
    word, remaining = rest[0], rest[1:]
    if word == "...":
        return []  # "any subcommand"
    problems: list[str] = []
    for alternative in word.split("|"):
        subcommand = command.get_command(context, alternative)
        if subcommand is None:
            problems.append(f"`{where}` has no subcommand {alternative!r}")
            continue
        problems += _check(subcommand, alternative, remaining, context, complete=complete)
    return problems
