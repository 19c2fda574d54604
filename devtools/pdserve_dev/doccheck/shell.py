"""The commands a shell would run from a fenced block, each with the line it starts on.

A logical line goes on past a trailing backslash and past a line break inside quotes. It is split as POSIX sh
would split words (`shlex`), then into commands at `|`, `&&`, `||`, `;` and `&`; a `# comment` ends it, and its
text is kept (a command expected to fail says so there: `# exits 1`). Redirections are dropped with their target;
a command fed by a pipe or `<` is marked, since its input is not a file the checker can see. Leading `VAR=value`
assignments, `sudo` and `env` are not the program. A console block's `$ ` prompts are dropped, and in a console
block only prompted lines are commands (the rest is output).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass

_SEPARATORS = {"|", "&&", "||", ";", "&", "|&"}
_REDIRECTS = {">", ">>", "<", ">&", "&>", "<<", "<<<", ">|"}
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_EXPECTED_EXIT = re.compile(r"\bexits (\d+)\b")
SHELL_LANGUAGES = frozenset({"bash", "sh", "shell", "console", "zsh"})


class ShellSyntaxError(ValueError):
    """A block the shell could not read (an unclosed quote at its end)."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(message)
        self.line = line


@dataclass(frozen=True)
class Command:
    line: int
    argv: tuple[str, ...]
    comment: str = ""
    stdin_redirected: bool = False

    @property
    def expected_exit(self) -> int:
        """0, or the status the comment says the command exits with (`# exits 1`)."""
        found = _EXPECTED_EXIT.search(self.comment)
        return int(found.group(1)) if found else 0


def logical_lines(
    lines: tuple[str, ...] | list[str], *, first_line: int = 1, console: bool = False
) -> Iterator[tuple[int, str]]:
    """(line number, text) of each logical line: continuations joined, quoted line breaks kept."""
    pending: list[str] = []
    start = first_line
    for offset, raw in enumerate(lines):
        number = first_line + offset
        line = raw
        if not pending:
            if console:
                if not line.lstrip().startswith("$ "):
                    continue
                line = line.lstrip()[2:]
            if line.strip() == "":
                continue
            start = number
        if line.rstrip().endswith("\\") and not line.rstrip().endswith("\\\\"):
            pending.append(line.rstrip()[:-1])
            continue
        pending.append(line)
        text = "\n".join(pending)
        if _split_comment(text)[2]:
            continue  # a quote still open: the line break is inside it
        pending = []
        yield start, text
    if pending:
        raise ShellSyntaxError(start, "a quote opened here is never closed")


def _split_comment(text: str) -> tuple[str, str, bool]:
    """(the code, the comment's text, whether a quote is still open at the end), as sh reads them: a `#` starts a
    comment only at the start of a word and outside quotes (`'` in a comment opens nothing)."""
    quote = ""
    escaped = False
    for index, char in enumerate(text):
        if escaped:
            escaped = False
        elif char == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or text[index - 1] in " \t\n;|&("):
            return text[:index], text[index + 1 :].strip(), False
    return text, "", bool(quote)


def _words(text: str) -> list[str]:
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = ""  # comments are taken off first (_split_comment), so that their text can be kept
    return list(lexer)


def commands(lines: tuple[str, ...] | list[str], *, first_line: int = 1, console: bool = False) -> Iterator[Command]:
    for number, text in logical_lines(lines, first_line=first_line, console=console):
        yield from split(text, line=number)


def split(text: str, *, line: int = 1) -> Iterator[Command]:
    """The commands of one logical line."""
    code, comment, _ = _split_comment(text)
    words = _words(code)
    current: list[str] = []
    piped = False
    redirected_in = False
    skip_next = False
    for word in [*words, ";"]:
        if skip_next:
            skip_next = False
            continue
        if word in _REDIRECTS:
            skip_next = True
            redirected_in = redirected_in or word.startswith("<")
            continue
        if word in _SEPARATORS:
            argv = _program_and_arguments(current)
            if argv:
                yield Command(line, argv, comment, stdin_redirected=piped or redirected_in)
            piped = word in {"|", "|&"}
            redirected_in = False
            current = []
            continue
        current.append(word)


def _program_and_arguments(words: list[str]) -> tuple[str, ...]:
    index = 0
    while index < len(words) and (_ASSIGNMENT.match(words[index]) or words[index] in {"sudo", "env"}):
        index += 1
    return tuple(words[index:])


def is_placeholder(word: str) -> bool:
    """A word that stands for a value the reader supplies: FILE, NAME-router, <version>, `...`."""
    return word == "..." or "<" in word or re.search(r"(?<![a-z])[A-Z]{2,}(?![a-z])|^[A-Z]$", word) is not None
