"""`kubectl ...` and `helm ...` as the documentation shows them, checked against the binaries' own `--help`.

Both are cobra programs: a command path (`kubectl auth can-i`), then flags. Their help lists subcommands in
sections whose title holds "Commands" and flags one a line, `  -n, --namespace string` (helm: a type word when the
flag takes a value) or `    -n, --namespace='':` (kubectl: a default, `=false`/`=true` for a switch). kubectl's
global flags are in `kubectl options`; helm lists them in every help under "Global Flags". The help of each path is
read once per process.

A line names the command path as far as its words are subcommands (a global flag and its value may come first);
every flag after it must be one the help lists for that path or a global one, and a shorthand cluster (`-it`) must
be all known shorthands. Values are not checked: that needs the cluster (kubectl) or is done by rendering (helm).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

# `  -n, --namespace string   text` (helm: a type word, one space after the name, when the flag takes a value) or
# `    -n, --namespace='':` (kubectl: the default, `=false`/`=true` for a switch).
_FLAG = re.compile(
    r"^\s+(?:-(?P<short>[A-Za-z0-9?]),\s+)?--(?P<long>[A-Za-z0-9][A-Za-z0-9-]*)"
    r"(?:(?P<default>=\S*?):| (?P<type>\S+)(?=\s{2,}|\s*$)|(?=\s{2,}|\s*$))"
)
_COMMAND = re.compile(r"^\s{2,}(?P<name>[a-z][a-z0-9-]*)\s{2,}\S")
_SWITCH_DEFAULTS = ("=false", "=true")


@dataclass
class Flags:
    """A command path's flags: long name -> takes a value, shorthand -> long name."""

    long: dict[str, bool] = field(default_factory=dict)
    short: dict[str, str] = field(default_factory=dict)

    def add(self, other: Flags) -> Flags:
        return Flags({**other.long, **self.long}, {**other.short, **self.short})


@dataclass
class Help:
    commands: set[str]
    flags: Flags


def parse_help(text: str) -> Help:
    """The subcommands and flags one `--help` text lists."""
    commands: set[str] = set()
    flags = Flags()
    in_commands = False
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            in_commands = False
            continue
        if not line.startswith(" ") and stripped.endswith(":"):
            in_commands = "Commands" in stripped
            continue
        if in_commands:
            found = _COMMAND.match(line)
            if found is not None:
                commands.add(found.group("name"))
            continue
        flag = _FLAG.match(line)
        if flag is None:
            continue
        default = flag.group("default")
        takes_value = default not in _SWITCH_DEFAULTS if default is not None else flag.group("type") is not None
        flags.long[flag.group("long")] = takes_value
        if flag.group("short"):
            flags.short[flag.group("short")] = flag.group("long")
    return Help(commands, flags)


class CobraProgram:
    """One cobra binary, asked for its help as the checks need it."""

    def __init__(self, name: str, binary: Path, *, global_help: Sequence[str] = ()) -> None:
        self.name = name
        self._binary = binary
        self._global_help = tuple(global_help)
        self._cache: dict[tuple[str, ...], Help] = {}
        self._globals: Flags | None = None

    def help(self, path: Sequence[str]) -> Help:
        key = tuple(path)
        if key not in self._cache:
            self._cache[key] = parse_help(self._run([*key, "--help"]))
        return self._cache[key]

    def global_flags(self) -> Flags:
        if self._globals is None:
            self._globals = parse_help(self._run(list(self._global_help))).flags if self._global_help else Flags()
        return self._globals

    def _run(self, args: list[str]) -> str:
        proc = subprocess.run([str(self._binary), *args], capture_output=True, text=True, timeout=60, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{self.name} {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc.stdout

    def split(self, args: Sequence[str]) -> tuple[list[str], list[str]]:
        """(the command path, the words after it)."""
        path: list[str] = []
        index = 0
        globals_ = self.global_flags().add(self.help(()).flags)
        while index < len(args):
            word = args[index]
            if word.startswith("-"):
                index += 1
                if "=" not in word and _takes_value(word, globals_):
                    index += 1  # the global flag's value
                continue
            if word not in self.help(path).commands:
                break
            path.append(word)
            index += 1
        return path, list(args[index:])

    def check(self, args: Sequence[str]) -> list[str]:
        """What is wrong with `NAME ARGS` (empty: every subcommand and flag exists)."""
        path, _ = self.split(args)
        known = self.help(path).flags.add(self.global_flags())
        command = " ".join([self.name, *path])
        problems: list[str] = []
        index = 0
        while index < len(args):
            word = args[index]
            index += 1
            if word == "--":
                break
            if not word.startswith("-") or word == "-":
                continue
            if word.startswith("--"):
                flag = word[2:].split("=", 1)[0]
                if flag not in known.long:
                    problems.append(f"`{command}` has no flag --{flag}")
                elif "=" not in word and known.long[flag]:
                    index += 1
                continue
            letters = word[1:]
            if letters[0] not in known.short:
                problems.append(f"`{command}` has no flag -{letters[0]}")
                continue
            long = known.short[letters[0]]
            if known.long.get(long, False):
                if len(letters) == 1:
                    index += 1  # `-n value`; `-nvalue` carries its own
                continue
            unknown = [letter for letter in letters[1:] if letter not in known.short]
            if unknown:
                problems.append(f"`{command}` has no flag -{unknown[0]} (in {word})")
        return problems


def _takes_value(word: str, flags: Flags) -> bool:
    if word.startswith("--"):
        return flags.long.get(word[2:], False)
    long = flags.short.get(word[1:2])
    return long is not None and len(word) == 2 and flags.long.get(long, False)


def positionals(program: CobraProgram, args: Sequence[str]) -> list[str]:
    """The words after the command path that are neither flags nor flag values."""
    path, rest = program.split(args)
    known = program.help(path).flags.add(program.global_flags())
    result: list[str] = []
    index = 0
    while index < len(rest):
        word = rest[index]
        index += 1
        if word.startswith("-") and word != "-":
            if "=" not in word and _takes_value(word, known):
                index += 1
            continue
        result.append(word)
    return result


def flag_values(program: CobraProgram, args: Sequence[str], names: Sequence[str]) -> list[str]:
    """Every value given to one of the flags `names` (`-f`, `--filename`), in either spelling."""
    values: list[str] = []
    for index, word in enumerate(args):
        for name in names:
            if word == name and index + 1 < len(args):
                values.append(args[index + 1])
            elif name.startswith("--") and word.startswith(name + "="):
                values.append(word[len(name) + 1 :])
    return values
