"""Reading manifest files for `pdserve validate` and `render`: untrusted input, bounded in every dimension.

A manifest may come from anyone (a pull request, a tenant), so reading one must cost about what a PDService costs,
whatever the file holds. Each bound fails with one line naming the file and, where there is one, the line:

- size: at most `max_bytes` are read (1 MiB by default; a PDService is about 2 KB), so a 37 MB file costs nothing;
- encoding: UTF-8 only; a bad byte is reported with its line, not as a UnicodeDecodeError traceback;
- nesting: at most `MAX_DEPTH` levels (PyYAML composes recursively; 50,000 `[` would hit Python's recursion limit);
- aliases: YAML aliases share one node, so a 600-byte "billion laughs" file is a small graph that becomes 10^9
  values once anything walks it (validation, error messages). The composed graph is measured as the tree it
  stands for, counting each shared node once per reference, and refused past `MAX_NODES`;
- duplicate keys: YAML keeps the last of two `uri:` silently; refused with the line of the second;
- two PDServices with the same namespace and name: `kubectl apply` would keep only the last; refused.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.events import Event
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from yaml.parser import Parser
from yaml.reader import Reader
from yaml.resolver import Resolver
from yaml.scanner import Scanner

try:
    from yaml._yaml import CParser
except ImportError:  # pragma: no cover - PyYAML built without libyaml
    CParser = None  # type: ignore[assignment,misc]

DEFAULT_MAX_BYTES = 1024 * 1024
MAX_DEPTH = 64
# A large PDService is a few hundred nodes; a file of many is bounded by its size. 100,000 leaves room for any
# honest input while a billion-laughs graph stops before it costs anything.
MAX_NODES = 100_000
_QUOTE_LIMIT = 60


class InputError(ValueError):
    """The input cannot be read as manifests; the message is one line, naming the file and line where known."""


class _RefusedError(Exception):
    """Raised inside the loader, which does not know the file's name; `read_documents` adds it."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(message)
        self.line, self.message = line, message


@dataclass(frozen=True)
class Document:
    """One YAML document of a manifest file."""

    index: int
    """1-based position in the file."""
    line: int
    """1-based line where it starts."""
    body: dict[str, Any]


def read_documents(path: str, *, max_bytes: int = DEFAULT_MAX_BYTES) -> list[Document]:
    """Every non-empty document of the file (`-`: stdin); raises InputError."""
    raw = _read_bounded(path, max_bytes)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise InputError(f"{path}: line {line}: not UTF-8 text (byte 0x{raw[exc.start]:02x})") from None
    loader = _loader(text)
    documents: list[Document] = []
    try:
        while loader.check_node():
            node = loader.get_node()
            if node is None:
                continue
            _check_expanded_size(node)
            body = loader.construct_document(node)
            if body is None:
                continue
            index = len(documents) + 1
            if not isinstance(body, dict):
                raise InputError(f"{path}: line {node.start_mark.line + 1}: document {index} is not a mapping")
            documents.append(Document(index, node.start_mark.line + 1, body))
    except _RefusedError as exc:
        raise InputError(f"{path}: line {exc.line}: {exc.message}") from None
    except yaml.MarkedYAMLError as exc:
        raise InputError(f"{path} is not valid YAML: {_describe(exc)}") from None
    except yaml.YAMLError as exc:
        raise InputError(f"{path} is not valid YAML: {_one_line(str(exc))}") from None
    finally:
        loader.dispose()
    return documents


def label(path: str, document: Document) -> str:
    """How messages name a document: `FILE: Kind/name`, with hostile values cut short."""
    body = document.body
    metadata = body.get("metadata")
    name = metadata.get("name") if isinstance(metadata, dict) else None
    return (
        f"{path}: {_quote(body.get('kind', '?'))}/{_quote(name if name is not None else f'document {document.index}')}"
    )


def identity(document: Document) -> tuple[str, str] | None:
    """(namespace, name) of a document, as `kubectl apply` would address it (no namespace: the current one)."""
    metadata = document.body.get("metadata")
    if not isinstance(metadata, dict) or not isinstance(metadata.get("name"), str):
        return None
    namespace = metadata.get("namespace")
    return (namespace if isinstance(namespace, str) else "", metadata["name"])


# ------------------------------------------------------------------------------------------------------ internals


def _read_bounded(path: str, max_bytes: int) -> bytes:
    try:
        if path == "-":
            raw = sys.stdin.buffer.read(max_bytes + 1)
        else:
            with Path(path).open("rb") as file:
                raw = file.read(max_bytes + 1)
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror}") from None
    if len(raw) > max_bytes:
        raise InputError(
            f"{path} is larger than {_size(max_bytes)}; a PDService manifest is a few KB "
            f"(raise the limit with --max-input-bytes)"
        )
    return raw


class _Bounded(Composer, SafeConstructor, Resolver):
    """PyYAML's safe composition and construction with a nesting limit and duplicate keys refused.

    Mixed into a loader with an event source (below); the composer here is PyYAML's Python one, which is what lets
    the depth be bounded, whichever parser produces the events.
    """

    def __init__(self) -> None:
        Composer.__init__(self)
        SafeConstructor.__init__(self)
        Resolver.__init__(self)
        self._depth = 0

    if TYPE_CHECKING:  # provided by the parser half; not defined here, so they never shadow it

        def peek_event(self) -> Event: ...

        def dispose(self) -> None: ...

    def compose_node(self, parent: Node | None, index: int) -> Node | None:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise _RefusedError(mark.line + 1 if mark else 0, f"nested more than {MAX_DEPTH} levels deep")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` merges keys the mapping may override: that is what it is for
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:
                continue  # an unhashable key: PyYAML reports it below
            if duplicate:
                raise _RefusedError(
                    key_node.start_mark.line + 1,
                    f"duplicate key {_quote(key)} (YAML would silently keep only this last value); remove one",
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


class _PythonLoader(Reader, Scanner, Parser, _Bounded):
    """Events from PyYAML's pure-Python parser."""

    def __init__(self, stream: str) -> None:
        Reader.__init__(self, stream)
        Scanner.__init__(self)
        Parser.__init__(self)
        _Bounded.__init__(self)


if CParser is not None:

    class _LibyamlLoader(_Bounded, CParser):
        """Events from libyaml's parser (about 6x faster than PyYAML's on a 1 MiB file); composed in Python."""

        def __init__(self, stream: str) -> None:
            CParser.__init__(self, stream)
            _Bounded.__init__(self)


def _loader(text: str) -> _Bounded:
    return _PythonLoader(text) if CParser is None else _LibyamlLoader(text)


def _check_expanded_size(root: Node) -> None:
    """Refuse a document whose node graph, read as a tree (aliases expanded), exceeds MAX_NODES.

    Sizes are memoised per node, so the walk costs the graph's size, not the tree's: a billion-laughs document is
    measured in microseconds.
    """
    sizes: dict[int, int] = {}
    for node in _post_order(root):
        if isinstance(node, SequenceNode):
            size = 1 + sum(sizes[id(child)] for child in node.value)
        elif isinstance(node, MappingNode):
            size = 1 + sum(sizes[id(key)] + sizes[id(value)] for key, value in node.value)
        else:
            size = 1
        sizes[id(node)] = size
        if size > MAX_NODES:
            raise _RefusedError(
                root.start_mark.line + 1,
                f"the document holds more than {MAX_NODES:,} values, counting each use of a YAML alias (a "
                "PDService has a few hundred); write it out without aliases",
            )


def _post_order(root: Node) -> Iterator[Node]:
    """Every node once, children before their parent (iterative: depth is bounded, but recursion is not needed)."""
    done: set[int] = set()
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if id(node) in done:
            continue
        if expanded or isinstance(node, ScalarNode):
            done.add(id(node))
            yield node
            continue
        stack.append((node, True))
        children = node.value if isinstance(node, SequenceNode) else [part for pair in node.value for part in pair]
        stack.extend((child, False) for child in reversed(children) if id(child) not in done)


def _describe(exc: yaml.MarkedYAMLError) -> str:
    mark = exc.problem_mark or exc.context_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    what = ", ".join(part for part in (exc.context, exc.problem) if part)
    return where + _one_line(what or "not valid YAML")


def _one_line(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= 300 else flat[:300] + "..."


def _quote(value: object) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= _QUOTE_LIMIT else text[:_QUOTE_LIMIT] + "..."


def _size(count: int) -> str:
    return f"{count // (1024 * 1024)} MiB" if count % (1024 * 1024) == 0 else f"{count:,} bytes"
