"""Every check of one documentation page, each problem as `PAGE:LINE: what is wrong`.

- commands: each command of a fenced shell block goes to its program's checker; a program without one is a
  problem (add a checker, or name it in `UNCHECKED` when there is nothing of the project's in it to check). Inline
  code spans that start with a checked program are checked too, as prose (`clicommand`). The offline `pdserve`
  subcommands (`crd`, `render`, `validate`) are run, and `helm install`/`upgrade`/`template` of the repository's
  chart is rendered with `helm template` and the same flags (a `--set` of a value the chart's schema lacks fails),
  each expecting exit status 0 or what its comment says (`# exits 1`).
- yaml: each YAML block parses; a PDService is validated as `pdserve validate` would; a fragment holding only
  `spec:` is validated merged into `examples/minimal.yaml`; the values of an Argo CD Application or a Flux
  HelmRelease on `charts/pdserve` are rendered with the chart.
- links: each relative link resolves to a file or folder of the repository, and a `#anchor` into a Markdown page
  to one of its headings.
- paths: an inline code span that is a repository path (its first segment a top-level entry) names something that
  exists (globs allowed).
- fences: every fence names its language, so no command can hide in an unlabelled block.
"""

from __future__ import annotations

import glob
import os
import shlex
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import yaml
from click.testing import CliRunner

from pdserve.api.validation import validate
from pdserve_dev.doccheck import clicommand, markdown, shell
from pdserve_dev.doccheck.cobra import CobraProgram, flag_values, positionals
from pdserve_dev.doccheck.programs import Programs

# Programs whose lines hold nothing of the project's to check (a shell builtin, a generic client, a third-party
# installer such as istioctl in docs/gateway.md).
UNCHECKED = frozenset(
    {"cd", "cat", "curl", "echo", "eval", "export", "git", "istioctl", "jq", "ls", "mkdir", "source", "sleep"}
)
PDSERVE = frozenset({"pdserve", ".venv/bin/pdserve"})
PYTHON = frozenset({"python", "python3", ".venv/bin/python"})
PIP = frozenset({"pip", ".venv/bin/pip"})
RUN_OFFLINE = frozenset({"crd", "render", "validate"})
CHART = "charts/pdserve"
YAML_LANGUAGES = frozenset({"yaml", "yml"})


@dataclass
class Tools:
    """What the checks run: pdserve's click root, the cobra binaries, helm for rendering."""

    cli: click.Command
    kubectl: CobraProgram
    helm: CobraProgram
    # `helm ARGS` -> (exit status, stderr).
    helm_run: Callable[[Sequence[str]], tuple[int, str]]
    programs: Programs


class PageChecker:
    def __init__(self, root: Path, tools: Tools) -> None:
        self.root = root
        self.tools = tools
        self._pages: dict[Path, markdown.Page] = {}
        self._top = {entry.name for entry in root.iterdir() if not entry.name.startswith(".")}
        minimal = yaml.safe_load((root / "examples" / "minimal.yaml").read_text())
        self._minimal: dict[str, Any] = minimal

    def page(self, path: Path) -> markdown.Page:
        path = path.resolve()
        if path not in self._pages:
            self._pages[path] = markdown.read(path)
        return self._pages[path]

    def _where(self, page: markdown.Page, line: int) -> str:
        return f"{page.path.relative_to(self.root)}:{line}"

    # --------------------------------------------------------------------------------------------- commands

    def commands(self, path: Path) -> list[str]:
        page = self.page(path)
        problems: list[str] = []
        shown: list[tuple[shell.Command, bool]] = []
        for fence in page.fences:
            if fence.language not in shell.SHELL_LANGUAGES:
                continue
            try:
                found = list(shell.commands(fence.lines, first_line=fence.line, console=fence.language == "console"))
            except shell.ShellSyntaxError as exc:
                problems.append(f"{self._where(page, exc.line)}: {exc}")
                continue
            shown += [(command, True) for command in found]
        for span in page.spans:
            words = _span_words(span.text)
            if words and (words[0] in PDSERVE or words[0] in {"kubectl", "helm", "vllm"} or _is_bench(words)):
                shown.append((shell.Command(span.line, tuple(words)), False))
        for command, fenced in shown:
            problems += [f"{self._where(page, command.line)}: {p}" for p in self._command(command, fenced)]
        return problems

    def _command(self, command: shell.Command, fenced: bool) -> list[str]:
        program, args = command.argv[0], list(command.argv[1:])
        if program in PDSERVE:
            return self._pdserve(command, args, fenced)
        if program == "kubectl":
            return self._kubectl(args, fenced)
        if program == "helm":
            return self._helm(command, args, fenced)
        if program in PYTHON:
            return self.tools.programs.python(args)
        if program in {"pytest", ".venv/bin/pytest"}:
            return self.tools.programs.pytest(args)
        if program in PIP:
            return self.tools.programs.pip(args)
        if program == "vllm":
            return self.tools.programs.vllm(args)
        if program.removeprefix("./").startswith("scripts/"):
            return self.tools.programs.script(command.argv)
        if program in UNCHECKED or not fenced:
            return []
        return [f"no check for the program {program!r}: add one to pdserve_dev.doccheck, or list it in UNCHECKED"]

    def _pdserve(self, command: shell.Command, args: list[str], fenced: bool) -> list[str]:
        problems = clicommand.check(self.tools.cli, args, complete=fenced)
        path = clicommand.leaf(self.tools.cli, args)
        runnable = (
            fenced
            and not problems
            and path[:1]
            and path[0] in RUN_OFFLINE
            and not command.stdin_redirected
            and not any(shell.is_placeholder(word) for word in args)
        )
        if runnable:
            result = CliRunner().invoke(self.tools.cli, args, catch_exceptions=True)
            if result.exit_code != command.expected_exit:
                output = (result.output or "").strip()[-400:]
                problems.append(
                    f"`pdserve {shlex.join(args)}` exited {result.exit_code}, not {command.expected_exit}: {output}"
                )
        return problems

    def _kubectl(self, args: list[str], fenced: bool) -> list[str]:
        kubectl = self.tools.kubectl
        problems = kubectl.check(args)
        if fenced and not problems:
            for value in flag_values(kubectl, args, ["-f", "--filename"]):
                if not (value == "-" or "://" in value or shell.is_placeholder(value) or (self.root / value).exists()):
                    problems.append(f"`kubectl`: no file {value}")
        return problems

    def _helm(self, command: shell.Command, args: list[str], fenced: bool) -> list[str]:
        helm = self.tools.helm
        problems = helm.check(args)
        if problems or not fenced:
            return problems
        path, rest = helm.split(args)
        names = positionals(helm, args)
        if path not in (["install"], ["upgrade"], ["template"]) or len(names) < 2 or names[1] != CHART:
            return []
        template_flags = helm.help(["template"]).flags
        own_flags = helm.help(path).flags.add(helm.global_flags())
        kept: list[str] = []
        index = 0
        while index < len(rest):
            word = rest[index]
            index += 1
            if not word.startswith("-"):
                continue
            name = word[2:].split("=", 1)[0] if word.startswith("--") else own_flags.short.get(word[1:2], "")
            takes_value = (
                "=" not in word
                and own_flags.long.get(name, False)
                and not (not word.startswith("--") and len(word) > 2)
            )
            value = [rest[index]] if takes_value and index < len(rest) else []
            index += len(value)
            if name in template_flags.long:
                kept += [word, *value]
        status, stderr = self.tools.helm_run(["template", names[0], CHART, *kept])
        if status != command.expected_exit:
            return [f"`helm template` of `helm {shlex.join(args)}` exited {status}: {stderr.strip()[-400:]}"]
        return []

    # ------------------------------------------------------------------------------------------------- yaml

    def yaml_blocks(self, path: Path) -> list[str]:
        page = self.page(path)
        problems: list[str] = []
        for fence in page.fences:
            if fence.language not in YAML_LANGUAGES:
                continue
            try:
                documents = [doc for doc in yaml.safe_load_all(fence.text) if doc is not None]
            except yaml.YAMLError as exc:
                problems.append(f"{self._where(page, fence.line)}: not YAML: {exc}")
                continue
            for document in documents:
                problems += [f"{self._where(page, fence.line)}: {p}" for p in self._document(document)]
        return problems

    def _document(self, document: Any) -> list[str]:
        if not isinstance(document, dict):
            return []
        if document.get("kind") == "PDService":
            return [f"PDService: {problem}" for problem in validate(document).problems]
        if set(document) == {"spec"}:
            merged = _merge(self._minimal, document)
            return [f"PDService fragment (on examples/minimal.yaml): {p}" for p in validate(merged).problems]
        values = _chart_values(document)
        if values is not None:
            with tempfile.NamedTemporaryFile("w", suffix=".yaml") as file:
                yaml.safe_dump(values, file)
                file.flush()
                status, stderr = self.tools.helm_run(["template", "pdserve", CHART, "-f", file.name])
            if status != 0:
                return [f"{document.get('kind')} values do not render with {CHART}: {stderr.strip()[-400:]}"]
        return []

    # ------------------------------------------------------------------------------------------------ links

    def links(self, path: Path) -> list[str]:
        page = self.page(path)
        problems = []
        for link in page.links:
            problem = self._link(page, link.target)
            if problem:
                problems.append(f"{self._where(page, link.line)}: {problem}")
        return problems

    def _link(self, page: markdown.Page, target: str) -> str | None:
        if ":" in target.split("/", 1)[0] or target.startswith("//"):
            return None  # a URL (https:, mailto:)
        file_part, _, anchor = target.partition("#")
        resolved = (page.path.parent / file_part).resolve() if file_part else page.path
        if not resolved.is_relative_to(self.root):
            return f"link {target} leaves the repository"
        if not resolved.exists():
            return f"link {target}: no such file"
        if anchor and resolved.suffix == ".md" and anchor not in self.page(resolved).anchors:
            return f"link {target}: {resolved.relative_to(self.root)} has no heading #{anchor}"
        return None

    # ------------------------------------------------------------------------------------------------ paths

    def paths(self, path: Path) -> list[str]:
        page = self.page(path)
        problems = []
        for span in page.spans:
            text = span.text.split("::", 1)[0].rstrip(",.;")
            if " " in text or "/" not in text or text.split("/", 1)[0] not in self._top:
                continue
            if not glob.glob(str(self.root / text.rstrip("/"))):
                problems.append(f"{self._where(page, span.line)}: `{span.text}` is not in the repository")
        return problems

    # ----------------------------------------------------------------------------------------------- fences

    def fences(self, path: Path) -> list[str]:
        page = self.page(path)
        problems = [
            f"{self._where(page, fence.line - 1)}: a fence without a language (```bash, ```yaml, ```text, ...)"
            for fence in page.fences
            if not fence.language
        ]
        if page.unclosed_fence is not None:
            problems.append(f"{self._where(page, page.unclosed_fence)}: a fence that is never closed")
        return problems

    def all(self, path: Path) -> list[str]:
        return [*self.fences(path), *self.commands(path), *self.yaml_blocks(path), *self.links(path), *self.paths(path)]


def _span_words(text: str) -> list[str]:
    """An inline span's words, with `[optional]` brackets taken off."""
    try:
        words = shlex.split(text)
    except ValueError:
        words = text.split()  # a value cut short with `...` inside quotes
    return [word.removeprefix("[").removesuffix("]") for word in words if word not in {"[", "]"}]


def _is_bench(words: list[str]) -> bool:
    return words[0] in PYTHON and len(words) > 1 and words[1].startswith("bench/")


def _merge(base: Mapping[str, Any], overlay: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overlay.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _chart_values(document: Mapping[str, Any]) -> dict[str, Any] | None:
    """The values an Argo CD Application or a Flux HelmRelease gives the repository's chart, if it is one."""
    spec = document.get("spec") or {}
    if document.get("kind") == "Application":
        source = spec.get("source") or {}
        if source.get("path") == CHART:
            values: dict[str, Any] = (source.get("helm") or {}).get("valuesObject") or {}
            return values
    if document.get("kind") == "HelmRelease":
        chart = ((spec.get("chart") or {}).get("spec") or {}).get("chart")
        if chart == CHART:
            release_values: dict[str, Any] = spec.get("values") or {}
            return release_values
    return None


_NOT_SOURCES = frozenset({"__pycache__", "build", "dist", "node_modules"})


def markdown_pages(root: Path) -> list[Path]:
    """The README, every page under docs/, then every other Markdown file of the repository (a page added later is
    checked without a change here); hidden folders (.git, .venv) and build output are not the repository's."""
    first = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    others = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(
            name
            for name in subfolders
            if not name.startswith(".") and name not in _NOT_SOURCES and not name.endswith(".egg-info")
        )
        others += [Path(folder) / name for name in sorted(files) if name.endswith(".md")]
    return [*first, *(page for page in others if page not in first)]
