"""The README, every `docs/*.md` page and every other Markdown file of the repository show only commands, flags,
links, paths and manifests that work.

Each page is its own test case (a page added later, under docs/ or anywhere, is checked without a change here):
every `pdserve` command line parses against the real click command tree and the offline ones run, every `kubectl`
and `helm` flag is one the binary's own `--help` lists, every `helm install`/`upgrade` of the chart renders with
`helm template`, every PDService shown validates, every relative link resolves (`pdserve_dev.doccheck` has the
rules). A failure lists each problem as `PAGE:LINE: what is wrong`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from pdserve.cli import main as pdserve_cli
from pdserve_dev.cluster import build
from pdserve_dev.doccheck.cobra import CobraProgram
from pdserve_dev.doccheck.markdown import read
from pdserve_dev.doccheck.pages import PageChecker, Tools, markdown_pages
from pdserve_dev.doccheck.programs import Programs
from pdserve_dev.doccheck.shell import commands
from pdserve_dev.testing.helm import helm

ROOT = Path(__file__).resolve().parents[2]
PAGES = list(markdown_pages(ROOT))

# Pages that other branches add; a link to one is accepted until it exists. Once it does, its entry must go (the
# last test says so), so that the list never hides a broken link.
PENDING_PAGES: frozenset[str] = frozenset()


def _helm_run(args: Sequence[str]) -> tuple[int, str]:
    proc = helm(*args, check=False)
    return proc.returncode, proc.stderr


@pytest.fixture(scope="module")
def checker() -> Iterator[PageChecker]:
    binaries = build.ensure_binaries(("kubectl", "helm"))
    tools = Tools(
        cli=pdserve_cli,
        kubectl=CobraProgram("kubectl", binaries / "kubectl", global_help=["options"]),
        helm=CobraProgram("helm", binaries / "helm"),
        helm_run=_helm_run,
        programs=Programs(ROOT, vllm_flags=ROOT / "tests" / "api" / "data" / "vllm-0.32-serve-flags.txt"),
    )
    here = Path.cwd()
    os.chdir(ROOT)  # the commands name paths relative to the repository, as a user types them there
    try:
        yield PageChecker(ROOT, tools)
    finally:
        os.chdir(here)


def _ids(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_the_pages_are_found() -> None:
    assert PAGES[0] == ROOT / "README.md"
    assert {ROOT / "docs" / "api.md", ROOT / "charts" / "pdserve" / "README.md"} <= set(PAGES), PAGES
    assert not [page for page in PAGES if ".venv" in page.parts], PAGES


@pytest.mark.parametrize("page", PAGES, ids=_ids)
def test_every_fence_names_its_language(checker: PageChecker, page: Path) -> None:
    problems = checker.fences(page)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=_ids)
def test_every_command_shown_parses_and_the_offline_ones_run(checker: PageChecker, page: Path) -> None:
    problems = checker.commands(page)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=_ids)
def test_every_manifest_shown_is_accepted(checker: PageChecker, page: Path) -> None:
    problems = checker.yaml_blocks(page)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=_ids)
def test_every_relative_link_resolves(checker: PageChecker, page: Path) -> None:
    problems = [p for p in checker.links(page) if not _pending(p)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=_ids)
def test_every_repository_path_named_exists(checker: PageChecker, page: Path) -> None:
    problems = checker.paths(page)
    assert not problems, "\n".join(problems)


def _pending(problem: str) -> bool:
    """A link to a page another branch adds, while that page is not here yet."""
    found = re.search(r"link (\S+?)(?:#\S*)?: no such file", problem)
    if found is None:
        return False
    page = Path(problem.split(":", 1)[0]).parent / found.group(1)
    return os.path.relpath(ROOT / page, ROOT) in PENDING_PAGES


def test_pending_pages_are_still_missing() -> None:
    arrived = sorted(page for page in PENDING_PAGES if (ROOT / page).exists())
    assert not arrived, f"{arrived} exist now: remove them from PENDING_PAGES in {Path(__file__).name}"


def test_the_readme_shows_the_two_commands_ci_runs() -> None:
    """The README's first block is the two commands: install and run the demo, then the tests, which is exactly
    what `.ci/run` runs."""
    readme = read(ROOT / "README.md")
    first = readme.fences[0]
    shown = [command.argv for command in commands(first.lines, first_line=first.line)]
    assert shown == [("./scripts/install.sh",), (".venv/bin/pdserve", "dev", "demo"), ("./scripts/test.sh",)]
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^exec \./scripts/test\.sh$", ci, re.MULTILINE), ci


def _command_paths(command: click.Command, path: tuple[str, ...], context: click.Context) -> Iterator[tuple[str, ...]]:
    yield path
    if isinstance(command, click.Group):
        for name in command.list_commands(context):
            sub = command.get_command(context, name)
            assert sub is not None, (path, name)
            yield from _command_paths(sub, (*path, name), click.Context(sub, parent=context, info_name=name))


COMMAND_PATHS = list(_command_paths(pdserve_cli, (), click.Context(pdserve_cli, info_name="pdserve")))


@pytest.mark.parametrize("path", COMMAND_PATHS, ids=lambda path: " ".join(("pdserve", *path)))
def test_every_subcommand_prints_its_help(path: tuple[str, ...]) -> None:
    """docs/cli.md sends readers to `--help` for every command's options (`pdserve sim serve` answers it itself: it
    takes vLLM's command line, `--help` included)."""
    result = CliRunner().invoke(pdserve_cli, [*path, "--help"], prog_name="pdserve")
    assert result.exit_code == 0, result.output
    usage = result.output.splitlines()[0]
    assert usage.startswith("Usage: pdserve") and all(name in usage for name in path), usage
