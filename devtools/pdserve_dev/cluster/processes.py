"""Start, track and stop the cluster's processes by PID, so nothing outlives the cluster.

Every process is started in its own session (its own process group), with output in `logs/<name>.log` and a
PID file `pids/<NN>-<name>.pid` holding "<pid> <start time>". The start time is the kernel's (field 22 of
/proc/<pid>/stat, in clock ticks since boot): a PID file whose process has exited and whose PID was reused by
something else has a different start time, so `stop` never signals a stranger. The NN prefix records start
order; processes are stopped one by one in reverse order (kwok before the API server, the API server before
etcd).

When the starter asks for it (`parent_death_signal`), the kernel also signals the process when the starting
process dies (prctl PR_SET_PDEATHSIG): a test run killed with SIGKILL then still tears its cluster down.
`pdserve dev cluster up` does not ask for it, since its processes must outlive the CLI.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _parent_death_signal(sig: signal.Signals) -> Callable[[], None]:
    def set_signal() -> None:  # pragma: no cover - runs in the child between fork and exec
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)

    return set_signal


def process_start_time(pid: int) -> int | None:
    """The kernel's start time of `pid` in clock ticks since boot, or None when no such process exists."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may contain spaces; split after its closing one.
    fields = stat[stat.rindex(")") + 2 :].split()
    state, start = fields[0], fields[19]
    if state == "Z":  # a zombie has exited; only its parent's wait() remains
        return None
    return int(start)


def boot_ticks_now() -> int:
    """Now, in the clock used by `process_start_time` (ticks since boot)."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))


@dataclass(frozen=True)
class Tracked:
    """A process we started (or the process node started) and may signal."""

    name: str
    pid: int
    start_time: int | None
    pid_file: Path

    def alive(self) -> bool:
        now = process_start_time(self.pid)
        if now is None:
            return False
        # A PID file without a start time (written by someone else) matches any process with that PID.
        return self.start_time is None or now == self.start_time


def spawn(
    name: str,
    argv: Sequence[str],
    workdir: Path,
    *,
    env: Mapping[str, str] | None = None,
    parent_death_signal: signal.Signals | None = signal.SIGKILL,
) -> tuple[subprocess.Popen[bytes], Tracked]:
    """Start `argv` in its own process group with its output in `workdir/logs/<name>.log` and record its PID.

    `parent_death_signal` is what the kernel sends the process when its starter dies (None: nothing, it
    outlives the starter). SIGKILL suits the control plane: its data is throw-away, and SIGTERMed all at
    once the API server hangs draining against a stopped etcd, with nobody left to kill it.
    """
    logs, pids = workdir / "logs", workdir / "pids"
    logs.mkdir(parents=True, exist_ok=True)
    pids.mkdir(parents=True, exist_ok=True)
    order = len(list(pids.glob("*.pid")))
    with (logs / f"{name}.log").open("ab") as log:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            cwd=workdir,
            start_new_session=True,
            preexec_fn=_parent_death_signal(parent_death_signal) if parent_death_signal else None,  # noqa: PLW1509
        )
    start = process_start_time(proc.pid)
    pid_file = pids / f"{order:02d}-{name}.pid"
    pid_file.write_text(f"{proc.pid} {start if start is not None else ''}\n")
    return proc, Tracked(name, proc.pid, start, pid_file)


def read_pid_file(path: Path) -> Tracked | None:
    """Parse "<pid> [<start time>]"; None for an unreadable or malformed file."""
    try:
        parts = path.read_text().split()
        pid = int(parts[0])
        start = int(parts[1]) if len(parts) > 1 else None
    except (OSError, ValueError, IndexError):
        return None
    name = path.stem.split("-", 1)[1] if path.stem[:2].isdigit() else path.stem
    return Tracked(name, pid, start, path)


def tracked_processes(pids_dir: Path) -> list[Tracked]:
    """Every process recorded in `pids_dir`, in start order."""
    found = (read_pid_file(path) for path in sorted(pids_dir.glob("*.pid")))
    return [t for t in found if t is not None]


def _signal_group(tracked: Tracked, sig: signal.Signals) -> None:
    # Each process leads its own group (start_new_session), so signalling the group also reaches helpers it
    # forked. Fall back to the single PID if it is not a group leader (e.g. a PID file someone else wrote).
    with contextlib.suppress(ProcessLookupError, PermissionError):
        try:
            os.killpg(tracked.pid, sig)
        except ProcessLookupError:
            os.kill(tracked.pid, sig)


def _reap(pid: int) -> None:
    # Collect our own exited children so they do not linger as zombies; others' children are not ours to wait.
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def stop(processes: Sequence[Tracked], timeout: float = 10.0) -> list[str]:
    """Stop the processes one after the other, in the given order; remove their PID files.

    Each gets SIGTERM, up to `timeout` seconds to exit, then SIGKILL. One at a time on purpose: signalled
    together, kube-apiserver loses etcd while it drains and hangs until killed (15 s instead of about 1 s).
    Returns the names of processes that needed SIGKILL (they ignored SIGTERM: worth a line in the log).
    """
    killed = []
    for tracked in processes:
        if tracked.alive():
            _signal_group(tracked, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while tracked.alive() and time.monotonic() < deadline:
                _reap(tracked.pid)
                time.sleep(0.02)
            if tracked.alive():
                killed.append(tracked.name)
                _signal_group(tracked, signal.SIGKILL)
                for _ in range(250):
                    _reap(tracked.pid)
                    if not tracked.alive():
                        break
                    time.sleep(0.02)
        tracked.pid_file.unlink(missing_ok=True)
    return killed


def stop_recorded(pids_dir: Path, timeout: float = 10.0) -> list[str]:
    """Stop everything recorded in `pids_dir`, newest first."""
    return stop(list(reversed(tracked_processes(pids_dir))), timeout)


def iter_alive(pids_dir: Path) -> Iterator[Tracked]:
    """The recorded processes that are still running."""
    return (t for t in tracked_processes(pids_dir) if t.alive())
