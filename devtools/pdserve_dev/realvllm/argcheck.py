"""Do the engine command lines pdserve renders parse with the installed vLLM's own argument parser?

:func:`engine_commands` collects every container that runs ``vllm`` from rendered objects (a StatefulSet's pod
template, a Pod, a Deployment); :func:`check` hands them all to ``argcheck_main.py`` in the engine's virtualenv
(one interpreter start, ~15 s to import vLLM) and returns one :class:`Verdict` per container. The parser is vLLM's,
so a flag vLLM renames or drops fails with argparse's own message naming the flag.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve_dev.realvllm import install

SCRIPT = Path(__file__).with_name("argcheck_main.py")


@dataclass(frozen=True)
class EngineCommand:
    """One engine container's command line: ``argv`` are the words after ``vllm``."""

    where: str
    argv: list[str]


@dataclass(frozen=True)
class Verdict:
    where: str
    ok: bool
    errors: list[str]
    parsed: dict[str, Any]


def _pod_spec(obj: dict[str, Any]) -> dict[str, Any] | None:
    if obj.get("kind") == "Pod":
        spec: dict[str, Any] | None = obj.get("spec")
        return spec
    return ((obj.get("spec") or {}).get("template") or {}).get("spec")


def engine_commands(objects: Iterable[dict[str, Any]], source: str) -> list[EngineCommand]:
    """Every container of `objects` whose command (or image entrypoint, `vllm serve`) runs vLLM."""
    found = []
    for obj in objects:
        spec = _pod_spec(obj) if isinstance(obj, dict) else None
        for container in (spec or {}).get("containers") or []:
            command = list(container.get("command") or [])
            if not command or os.path.basename(command[0]) != "vllm":
                continue
            where = f"{source}: {obj['kind']}/{obj['metadata']['name']} container {container['name']}"
            found.append(EngineCommand(where, command[1:] + list(container.get("args") or [])))
    return found


def check(commands: list[EngineCommand], timeout: float = 300.0) -> list[Verdict]:
    """Parse every command with the installed vLLM; raises RuntimeError when the checker itself fails."""
    if not install.installed():
        raise RuntimeError(install.missing_message())
    payload = json.dumps([{"where": c.where, "argv": c.argv} for c in commands])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "ERROR"}
    proc = subprocess.run(
        [str(install.engine_python()), str(SCRIPT)],
        input=payload, capture_output=True, text=True, timeout=timeout, check=False, env=env,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"argcheck_main.py exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return [Verdict(**item) for item in json.loads(proc.stdout)]
