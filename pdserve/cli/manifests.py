"""`pdserve crd`, `pdserve render` and `pdserve validate`: offline commands over PDService manifests.

All three read YAML (a file or `-` for stdin; several `---` documents allowed) and never talk to a cluster.
`render` prints what the operator would create, as a multi-document YAML stream like `helm template`; objects
carry no ownerReference unless the input has a metadata.uid (a stored object).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
import yaml

from pdserve.api.crdgen import crd_yaml
from pdserve.api.v1alpha1 import KIND
from pdserve.api.validation import Problem
from pdserve.api.validation import validate as validate_document


class _Dumper(yaml.SafeDumper):
    """Block-style YAML with multi-line strings as literal blocks (readable ConfigMaps) and no anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str_presenter(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str_presenter)


def dump_stream(objects: list[dict[str, Any]]) -> str:
    return "".join("---\n" + yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=120) for obj in objects)


def _read_documents(path: str) -> list[tuple[str, dict[str, Any]]]:
    """Documents of a file as (label for messages, mapping); raises ClickException on unreadable input."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise click.ClickException(f"cannot read {path}: {exc.strerror}") from exc
    try:
        documents = [doc for doc in yaml.safe_load_all(text) if doc is not None]
    except yaml.YAMLError as exc:
        raise click.ClickException(f"{path} is not valid YAML: {exc}") from exc
    result: list[tuple[str, dict[str, Any]]] = []
    for index, doc in enumerate(documents):
        if not isinstance(doc, dict):
            raise click.ClickException(f"{path}: document {index + 1} is not a mapping")
        name = (doc.get("metadata") or {}).get("name", f"document {index + 1}")
        result.append((f"{path}: {doc.get('kind', '?')}/{name}", doc))
    if not result:
        raise click.ClickException(f"{path} holds no documents")
    return result


def _pdservices(path: str) -> list[tuple[str, dict[str, Any]]]:
    docs = _read_documents(path)
    kept = [(label, doc) for label, doc in docs if doc.get("kind") == KIND]
    if not kept:
        raise click.ClickException(f"{path} holds no {KIND} (kind: {KIND})")
    return kept


@click.command()
def crd() -> None:
    """Print the generated PDService CustomResourceDefinition."""
    click.echo(crd_yaml(), nl=False)


@click.command()
@click.option("-f", "--filename", "path", required=True, help="PDService manifest (YAML), or - for stdin.")
def render(path: str) -> None:
    """Print every object the operator would create for the PDService(s) in FILE."""
    from pdserve_operator.render import render as render_objects

    objects: list[dict[str, Any]] = []
    for label, doc in _pdservices(path):
        checked = validate_document(doc)
        if not checked.ok:
            _report(label, checked.problems)
            raise SystemExit(1)
        objects += render_objects(checked)
    click.echo(dump_stream(objects), nl=False)


@click.command(name="validate")
@click.option("-f", "--filename", "path", required=True, help="PDService manifest (YAML), or - for stdin.")
def validate_command(path: str) -> None:
    """Check the PDService(s) in FILE; print every problem and exit 1 if there is any."""
    failed = False
    for label, doc in _pdservices(path):
        problems = validate_document(doc).problems
        if problems:
            failed = True
            _report(label, problems)
        else:
            click.echo(f"{label}: valid")
    if failed:
        raise SystemExit(1)


def _report(label: str, problems: Sequence[Problem]) -> None:
    click.echo(f"{label}: {len(problems)} problem(s)", err=True)
    for problem in problems:
        click.echo(f"  - {problem}", err=True)


validate = validate_command
