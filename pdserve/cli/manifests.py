"""`pdserve crd`, `pdserve render` and `pdserve validate`: offline commands over PDService manifests.

All three read YAML (a file or `-` for stdin; several `---` documents allowed) and never talk to a cluster.
`render` prints what the operator would create, as a multi-document YAML stream like `helm template`; objects
carry no ownerReference unless the input has a metadata.uid (a stored object).

Input is untrusted and bounded (`documents.py`): size, encoding, nesting, YAML aliases and duplicate keys each
fail with one line and exit status 1, and a document's problems are listed at most `MAX_LISTED` at a time.
`--allow-model-host-paths` checks a spec against the node folders a cluster's operator allows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import click
import yaml

from pdserve.api.crdgen import crd_yaml
from pdserve.api.policy import HOST_PATH_FLAG, Policy, PolicyError
from pdserve.api.v1alpha1 import KIND
from pdserve.api.validation import Problem
from pdserve.api.validation import validate as validate_document
from pdserve.cli.documents import DEFAULT_MAX_BYTES, Document, InputError, identity, label, read_documents

# Problems printed per document: the first ones show what is wrong; thousands (a generated or hostile file) would
# only bury them.
MAX_LISTED = 50

F = TypeVar("F", bound=Callable[..., Any])


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


def _manifest_options(command: F) -> F:
    """The options `render` and `validate` share: the file, the input bound and the cluster policy."""
    command = click.option(
        HOST_PATH_FLAG,
        "model_host_paths",
        multiple=True,
        metavar="PREFIX",
        help="A node folder the cluster's operator allows spec.model.uri to name (repeatable); default: none.",
    )(command)
    command = click.option(
        "--max-input-bytes",
        type=click.IntRange(min=1),
        default=DEFAULT_MAX_BYTES,
        show_default=True,
        help="Refuse larger input.",
    )(command)
    return click.option("-f", "--filename", "path", required=True, help="PDService manifest (YAML), or - for stdin.")(
        command
    )


def _policy(model_host_paths: Sequence[str]) -> Policy:
    try:
        return Policy.allowing(model_host_paths=model_host_paths)
    except PolicyError as exc:
        raise click.BadParameter(str(exc), param_hint=HOST_PATH_FLAG) from None


def _pdservices(path: str, max_bytes: int) -> list[tuple[str, Document, list[Problem]]]:
    """The PDService documents of the file, each with the problems only the file shows (a name used twice)."""
    try:
        documents = read_documents(path, max_bytes=max_bytes)
    except InputError as exc:
        raise click.ClickException(str(exc)) from None
    if not documents:
        raise click.ClickException(f"{path} holds no documents")
    kept = [document for document in documents if document.body.get("kind") == KIND]
    if not kept:
        raise click.ClickException(f"{path} holds no {KIND} (kind: {KIND})")
    first: dict[tuple[str, str], Document] = {}
    result = []
    for document in kept:
        problems = []
        key = identity(document)
        if key is not None and key in first:
            where = f"namespace {key[0]}" if key[0] else "the same namespace"
            problems.append(
                Problem(
                    "metadata.name",
                    f"{KIND} {key[1]} in {where} is defined twice (document {first[key].index}, line "
                    f"{first[key].line}); applying the file would keep only the last one: rename or remove one",
                )
            )
        elif key is not None:
            first[key] = document
        result.append((label(path, document), document, problems))
    return result


@click.command()
def crd() -> None:
    """Print the generated PDService CustomResourceDefinition."""
    click.echo(crd_yaml(), nl=False)


@click.command()
@_manifest_options
def render(path: str, max_input_bytes: int, model_host_paths: tuple[str, ...]) -> None:
    """Print every object the operator would create for the PDService(s) in FILE."""
    from pdserve_operator.render import render as render_objects

    policy = _policy(model_host_paths)
    objects: list[dict[str, Any]] = []
    failed = False
    for name, document, file_problems in _pdservices(path, max_input_bytes):
        checked = validate_document(document.body, policy)
        if file_problems or not checked.ok:
            failed = True
            _report(name, [*file_problems, *checked.problems])
        elif not failed:
            objects += render_objects(checked)
    if failed:
        raise SystemExit(1)
    click.echo(dump_stream(objects), nl=False)


@click.command(name="validate")
@_manifest_options
def validate_command(path: str, max_input_bytes: int, model_host_paths: tuple[str, ...]) -> None:
    """Check the PDService(s) in FILE; print every problem and exit 1 if there is any."""
    policy = _policy(model_host_paths)
    failed = False
    for name, document, file_problems in _pdservices(path, max_input_bytes):
        problems = [*file_problems, *validate_document(document.body, policy).problems]
        if problems:
            failed = True
            _report(name, problems)
        else:
            click.echo(f"{name}: valid")
    if failed:
        raise SystemExit(1)


def _report(name: str, problems: Sequence[Problem]) -> None:
    click.echo(f"{name}: {len(problems)} problem(s)", err=True)
    for problem in problems[:MAX_LISTED]:
        click.echo(f"  - {problem}", err=True)
    if len(problems) > MAX_LISTED:
        click.echo(f"  ... and {len(problems) - MAX_LISTED} more", err=True)


validate = validate_command
