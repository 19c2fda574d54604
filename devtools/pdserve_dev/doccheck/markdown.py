"""What a Markdown page shows: fenced blocks, inline code spans, links and heading anchors, each with its line.

A small reader of the CommonMark/GitHub subset the project's pages use, not a full Markdown parser: fences of
backticks or tildes (closed by a fence of the same character, at least as long), inline code spans (which may run
over a line break; in a table row `\\|` is a literal `|`), inline links and images `[text](target)`, reference
definitions `[label]: target`, and ATX headings `#`..`######`, whose anchors follow GitHub's rule (lower case,
punctuation dropped, spaces to hyphens, `-1`, `-2`... for repeats). Links and spans are never looked for inside
fences, and links never inside code spans.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
# A run of backticks, the shortest text, then a run of the same length (not part of a longer run).
_CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(?:<([^>]*)>|([^()\s]+))(?:\s+\"[^\"]*\")?\s*\)", re.DOTALL)
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")


@dataclass(frozen=True)
class Fence:
    """A fenced block: its info string's first word (the language) and its lines; `line` is the first content
    line's number (1-based)."""

    line: int
    language: str
    lines: tuple[str, ...]

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


@dataclass(frozen=True)
class Span:
    """Inline code: its text with line breaks as spaces, and the line it starts on."""

    line: int
    text: str


@dataclass(frozen=True)
class Link:
    line: int
    target: str


@dataclass
class Page:
    path: Path
    fences: list[Fence] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)
    anchors: set[str] = field(default_factory=set)
    unclosed_fence: int | None = None


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (before deduplication)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays, its target goes
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def read(path: Path) -> Page:
    return parse(path, path.read_text(encoding="utf-8"))


def parse(path: Path, text: str) -> Page:
    page = Page(path)
    lines = text.split("\n")
    prose: list[tuple[int, str]] = []
    seen: dict[str, int] = {}
    index = 0
    while index < len(lines):
        line = lines[index]
        opening = _FENCE.match(line)
        if opening is None:
            heading = _HEADING.match(line)
            if heading is not None:
                base = slug(heading.group(2))
                count = seen.get(base, 0)
                seen[base] = count + 1
                page.anchors.add(base if count == 0 else f"{base}-{count}")
            prose.append((index + 1, line))
            index += 1
            continue
        fence = opening.group("fence")
        body: list[str] = []
        end = index + 1
        while end < len(lines):
            closing = _FENCE.match(lines[end])
            if _closes(closing, fence):
                break
            body.append(lines[end])
            end += 1
        else:
            page.unclosed_fence = index + 1
        info = opening.group("info").strip()
        page.fences.append(Fence(index + 2, info.split()[0] if info else "", tuple(body)))
        prose.append((index + 1, ""))  # a fence ends the paragraph before it
        index = end + 1
    for start, paragraph in _paragraphs(prose):
        _read_paragraph(page, start, paragraph)
    return page


def _closes(candidate: re.Match[str] | None, fence: str) -> bool:
    """A closing fence: the opening's character, at least as long, nothing after it."""
    return (
        candidate is not None
        and candidate.group("fence")[0] == fence[0]
        and len(candidate.group("fence")) >= len(fence)
        and not candidate.group("info").strip()
    )


def _paragraphs(prose: list[tuple[int, str]]) -> list[tuple[int, list[str]]]:
    """Runs of non-blank lines, with the number of each run's first line."""
    result: list[tuple[int, list[str]]] = []
    current: list[str] = []
    start = 0
    for number, line in prose:
        if line.strip() == "":
            if current:
                result.append((start, current))
            current = []
            continue
        if not current:
            start = number
        current.append(line)
    if current:
        result.append((start, current))
    return result


def _read_paragraph(page: Page, start: int, lines: list[str]) -> None:
    text = "\n".join(lines)

    def line_of(offset: int) -> int:
        return start + text.count("\n", 0, offset)

    masked = list(text)
    for match in _CODE_SPAN.finditer(text):
        content = match.group(2)
        row = text[text.rfind("\n", 0, match.start()) + 1 :]
        if row.lstrip().startswith("|"):
            content = content.replace("\\|", "|")
        page.spans.append(Span(line_of(match.start()), content.replace("\n", " ").strip()))
        masked[match.start() : match.end()] = " " * (match.end() - match.start())
    prose = "".join(masked)
    for match in _LINK.finditer(prose):
        target = match.group(1) if match.group(1) is not None else match.group(2)
        page.links.append(Link(line_of(match.start()), target))
    for offset, line in enumerate(prose.split("\n")):
        reference = _REFERENCE.match(line)
        if reference is not None:
            page.links.append(Link(start + offset, reference.group(1)))
