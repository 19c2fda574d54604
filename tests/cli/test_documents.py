"""The bounded manifest reader, with libyaml's parser and with PyYAML's pure-Python one (the fallback)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.cli import documents
from pdserve.cli.documents import InputError, read_documents


@pytest.fixture(params=["libyaml", "python"])
def parser(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "python":
        monkeypatch.setattr(documents, "CParser", None)
    elif getattr(documents, "CParser", None) is None:
        pytest.skip("PyYAML without libyaml")
    yield request.param


def read(tmp_path: Path, text: str, max_bytes: int = documents.DEFAULT_MAX_BYTES) -> list[documents.Document]:
    path = tmp_path / "in.yaml"
    path.write_text(text)
    return read_documents(str(path), max_bytes=max_bytes)


def test_documents_with_their_lines(tmp_path: Path, parser: str) -> None:
    found = read(tmp_path, "a: 1\n---\n---\nkind: X\nmetadata: {name: y}\n")
    assert [(d.index, d.line, d.body) for d in found] == [
        (1, 1, {"a": 1}),
        (2, 4, {"kind": "X", "metadata": {"name": "y"}}),
    ]
    assert documents.label("f", found[1]) == "f: X/y"
    assert documents.identity(found[1]) == ("", "y")


def test_merge_keys_may_be_overridden(tmp_path: Path, parser: str) -> None:
    (found,) = read(tmp_path, "base: &b {x: 1, y: 2}\nuse:\n  <<: *b\n  x: 3\n")
    assert found.body["use"] == {"x": 3, "y": 2}


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("a: 1\nb:\n  c: 1\n  c: 2\n", "line 4: duplicate key c"),
        ("[" * 65 + "]" * 65, "nested more than 64"),
        ("a: [1, 2\n", "not valid YAML: line 2"),
        ("- 1\n", "document 1 is not a mapping"),
        ("a: &x [" + ", ".join(["1"] * 400) + "]\nb: [" + ", ".join(["*x"] * 300) + "]\n", "aliases"),
    ],
)
def test_refusals_name_the_line(tmp_path: Path, parser: str, text: str, fragment: str) -> None:
    with pytest.raises(InputError) as info:
        read(tmp_path, text)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_size_and_encoding(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="larger than 100 bytes"):
        read(tmp_path, "a: " + "x" * 200, max_bytes=100)
    path = tmp_path / "bad.yaml"
    path.write_bytes(b"a: 1\nb: \xff\n")
    with pytest.raises(InputError, match=r"line 2: not UTF-8 text \(byte 0xff\)"):
        read_documents(str(path))


def test_hostile_names_are_cut_short_in_labels(tmp_path: Path) -> None:
    (found,) = read(tmp_path, f"kind: {'K' * 500}\nmetadata: {{name: {'n' * 500}}}\n")
    assert len(documents.label("f", found)) < 150
