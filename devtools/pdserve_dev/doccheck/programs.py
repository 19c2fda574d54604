"""The repository's own programs as the documentation shows them: benchmarks, scripts, pip installs, `vllm serve`.

- `python bench/X.py ...`: the script exists and every option is one its argparse parsers define, spelled in full
  (argparse would accept an abbreviation that a later option could make ambiguous).
- `./scripts/X.sh`: the script exists and is executable; `scripts/test.sh` and `pytest` name registered markers
  (`-m EXPR`) and test paths that exist only.
- `pip install -e '.[extra]'`: the folder exists and the extra is one of the project's optional dependencies.
- `vllm serve MODEL --flag`: every flag is one of vLLM's (the list the owned-flag checks use).
"""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

_PYTEST_EXPRESSION_WORDS = {"and", "or", "not"}


class Programs:
    def __init__(self, root: Path, *, vllm_flags: Path) -> None:
        self.root = root
        self._vllm_flags = vllm_flags

    # ---------------------------------------------------------------------------------------------- benchmarks

    @cache  # noqa: B019 (one Programs per test session; each script is read once)
    def _script_options(self, script: str) -> frozenset[str]:
        """Every option string the script's argparse parsers define: the literal names of its `add_argument` calls,
        subcommands' included. Read from the source, not from `--help`: the benchmarks import their whole stack
        (seconds each on a busy machine) and define their options only as literals."""
        tree = ast.parse((self.root / script).read_text(), filename=script)
        return frozenset(
            argument.value
            for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"
            for argument in node.args
            if isinstance(argument, ast.Constant) and isinstance(argument.value, str) and argument.value.startswith("-")
        )

    def python(self, args: Sequence[str]) -> list[str]:
        """`python ARGS`: a repository script with its options, or `-m pytest ...`; other `-m`/`-c` are not checked."""
        if args[:2] == ["-m", "pytest"]:
            return self.pytest(args[2:])
        if not args or args[0] in {"-m", "-c"}:
            return []
        script = args[0]
        if not (self.root / script).is_file():
            return [f"no script {script}"]
        options = self._script_options(script) | {"-h", "--help"}
        return [
            f"`{script}` has no option {word.split('=', 1)[0]}"
            for word in args[1:]
            if word.startswith("--") and word.split("=", 1)[0] not in options
        ]

    # ------------------------------------------------------------------------------------------------- scripts

    def script(self, args: Sequence[str]) -> list[str]:
        path = self.root / args[0].removeprefix("./")
        if not path.is_file():
            return [f"no script {args[0]}"]
        if not path.stat().st_mode & 0o111:
            return [f"{args[0]} is not executable"]
        if path.name == "test.sh":
            return self.pytest(args[1:])
        return []

    def pytest(self, args: Sequence[str]) -> list[str]:
        """`pytest ARGS` (or `scripts/test.sh ARGS`): registered markers in `-m`, test paths that exist."""
        missing = [
            f"no test path {word}"
            for word in args
            if word.startswith("tests/") and not (self.root / word.split("::", 1)[0]).exists()
        ]
        return [*missing, *self._pytest_markers(args)]

    def _pytest_markers(self, args: Sequence[str]) -> list[str]:
        registered = {
            line.split(":", 1)[0].strip() for line in self._pyproject()["tool"]["pytest"]["ini_options"]["markers"]
        }
        problems = []
        for index, word in enumerate(args[:-1]):
            if word != "-m":
                continue
            for name in re.findall(r"[A-Za-z_]\w*", args[index + 1]):
                if name not in _PYTEST_EXPRESSION_WORDS and name not in registered:
                    problems.append(f"no pytest marker {name!r} (registered: {', '.join(sorted(registered))})")
        return problems

    # ----------------------------------------------------------------------------------------------------- pip

    def pip(self, args: Sequence[str]) -> list[str]:
        if not args or args[0] != "install":
            return []
        extras = set(self._pyproject()["project"].get("optional-dependencies", {}))
        problems = []
        for word in args[1:]:
            found = re.fullmatch(r"(\.[\w./-]*)(?:\[([\w,-]+)\])?", word)
            if found is None:
                continue
            folder, wanted = found.group(1), found.group(2)
            if not (self.root / folder).is_dir():
                problems.append(f"no folder {folder} to install")
            if wanted and folder in {".", "./"}:
                problems += [f"no extra [{name}] in pyproject.toml" for name in wanted.split(",") if name not in extras]
        return problems

    @cache  # noqa: B019
    def _pyproject(self) -> dict[str, Any]:
        return tomllib.loads((self.root / "pyproject.toml").read_text())

    # ---------------------------------------------------------------------------------------------------- vLLM

    def vllm(self, args: Sequence[str]) -> list[str]:
        if not args or args[0] != "serve":
            return []
        known = {
            line.strip()
            for line in self._vllm_flags.read_text().splitlines()
            if line.strip() and not line.startswith("#")
        }
        return [
            f"`vllm serve` has no flag {flag}"
            for word in args[1:]
            if word.startswith("--") and (flag := word.split("=", 1)[0].split(".", 1)[0]) not in known
        ]
