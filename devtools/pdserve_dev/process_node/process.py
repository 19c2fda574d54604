"""One container run as a local process: start, PID file, log file, exit, graceful stop.

Each process is a session (and process group) leader, so a signal to the group also reaches anything it
forked, and a Ctrl-C in the terminal that started the cluster does not hit pods directly. The PID file exists
exactly while the process runs; the log file is appended to across restarts, each run starting with a marker
line, so the harness can show a container's whole history.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from pdserve_dev.process_node.podstatus import rfc3339

log = logging.getLogger(__name__)


def exit_code(returncode: int) -> int:
    """A Popen return code as a container exit code (killed by signal N -> 128 + N, like a shell)."""
    return 128 - returncode if returncode < 0 else returncode


class LocalProcess:
    """A running (or finished) container process."""

    def __init__(self, popen: subprocess.Popen[bytes], pid_path: Path, started_at: float) -> None:
        self._popen = popen
        self.pid = popen.pid
        self.pid_path = pid_path
        self.started_at = started_at
        self.started_monotonic = time.monotonic()
        self.finished_at: float | None = None

    @classmethod
    def start(
        cls,
        argv: list[str],
        *,
        env: Mapping[str, str],
        cwd: Path,
        log_path: Path,
        pid_path: Path,
        on_exit: Callable[[], None] | None = None,
    ) -> LocalProcess:
        """Start ``argv``; raise OSError when it cannot be executed (the caller reports StartError)."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        pid_path.parent.mkdir(parents=True, exist_ok=True)
        started_at = time.time()
        with log_path.open("ab") as log_file:
            log_file.write(f"--- process-node: {rfc3339(started_at)} exec {argv!r}\n".encode())
            log_file.flush()
            popen = subprocess.Popen(
                argv,
                cwd=cwd,
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        # The child holds its own copy of the log descriptor; ours is closed by the with block.
        pid_path.write_text(f"{popen.pid}\n")
        process = cls(popen, pid_path, started_at)
        if on_exit is not None:
            # A waiter thread turns the exit into a wake-up instead of polling every container.
            threading.Thread(target=process._wait_then, args=(on_exit,), daemon=True, name=f"wait-{popen.pid}").start()
        return process

    def _wait_then(self, callback: Callable[[], None]) -> None:
        self._popen.wait()
        callback()

    def poll(self) -> int | None:
        """The container exit code once the process has exited (the PID file is then gone), else None."""
        returncode = self._popen.poll()
        if returncode is None:
            return None
        self._finished()
        return exit_code(returncode)

    def _finished(self) -> None:
        if self.finished_at is None:
            self.finished_at = time.time()
        # Remove the file only while it still names this process (a new pod of the same name may own it).
        with contextlib.suppress(OSError):
            if self.pid_path.read_text().strip() == str(self.pid):
                self.pid_path.unlink()

    @property
    def ran_for(self) -> float:
        return time.monotonic() - self.started_monotonic

    def stop(self, grace: float) -> int:
        """SIGTERM the process group, SIGKILL it after ``grace`` seconds; return the exit code."""
        signal_group(self.pid, signal.SIGTERM)
        try:
            returncode = self._popen.wait(timeout=max(grace, 0.0))
        except subprocess.TimeoutExpired:
            log.info("Killed process group after grace period pid=%s grace=%.0fs", self.pid, grace)
            signal_group(self.pid, signal.SIGKILL)
            returncode = self._popen.wait()
        # Children that ignored SIGTERM while the leader exited must not outlive the container.
        signal_group(self.pid, signal.SIGKILL)
        self._finished()
        return exit_code(returncode)


def signal_group(pgid: int, signum: int) -> None:
    """Send ``signum`` to a process group that may already be gone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def kill_stale(pid_path: Path) -> None:
    """Kill the process group a leftover PID file names, if it is still a session leader, then drop the file.

    Leftover PID files come from a process node that died without stopping its pods. Checking that the PID is
    a session leader (field 6 of /proc/PID/stat equals the PID) guards against signalling a reused PID.
    """
    try:
        pid = int(pid_path.read_text().strip())
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        pid = 0
        stat = ""
    # The command name in field 2 may contain spaces; fields after the closing parenthesis are fixed.
    fields = stat.rpartition(")")[2].split()
    if pid > 0 and len(fields) > 3 and fields[3] == str(pid):
        log.warning("Killed leftover container process pid=%s file=%s", pid, pid_path)
        signal_group(pid, signal.SIGKILL)
    with contextlib.suppress(FileNotFoundError):
        pid_path.unlink()
