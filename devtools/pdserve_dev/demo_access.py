"""How a user reaches a kept demo (`pdserve dev demo --keep`) from their own shell.

The demo runs in a network namespace of its own (`cluster.netns`), so its addresses (the router's pod address in
198.18.0.0/15, Prometheus' and the API server's loopback ports) exist only there. Two processes share the work:

- outside, the `pdserve dev demo` process the user started (`run_isolated`): it starts the demo in a fresh
  namespace with a pipe for one message, and when the demo says it keeps running, publishes the router, Prometheus
  and the API server on 127.0.0.1 of the user's namespace (`publish.serve_outer`), writes a kubeconfig that points
  at the published API server, and prints only those addresses. A signal (Ctrl-C, SIGTERM) is passed on to the demo
  as SIGTERM (the demo runs in a session of its own, so it gets exactly one); the listeners close and the process
  exits with the demo's status once the demo has stopped its cluster. The demo gets SIGTERM too if this process
  dies.
- inside, the demo (`publish_inside`): it relays unix sockets in its private working folder to the services
  (`publish.serve_inner`; the router looked up again if its pod is replaced), sends their paths through the pipe,
  and serves until it is told to stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from pdserve_dev import publish
from pdserve_dev.cluster import build, netns

CONTROL_ENV = "PDSERVE_DEMO_CONTROL_FD"
"""Set in the demo started inside: the pipe (a file descriptor number) its `Kept` message goes to."""
PARENT_ENV = "PDSERVE_DEMO_PARENT_PID"
"""Set with it: the process outside, which the demo inside must not outlive."""
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Kept:
    """What the demo inside tells the process outside once it keeps running."""

    workdir: str
    kubeconfig: str
    sockets: dict[str, str]
    """Service name (`router`, `prometheus`, `apiserver`) -> unix socket path."""
    namespace: str
    name: str
    model: str
    operator_logs: str


@dataclass(frozen=True)
class Access:
    """The addresses a user types, and the files that hold them."""

    router: str
    prometheus: str
    apiserver: str
    kubeconfig: str
    env_file: str


def address_of(url: str) -> publish.Address:
    """(host, port) of an http(s) URL with an explicit port."""
    parts = urlsplit(url)
    if parts.hostname is None or parts.port is None:
        raise ValueError(f"No host and port in {url!r}")
    return parts.hostname, parts.port


# ------------------------------------------------------------------------------------------------------ inside


def control_fd() -> int | None:
    """The pipe to the process outside, when this demo was started by one (`run_isolated`); this process then also
    ends with it (it runs in a session of its own, out of reach of the terminal's Ctrl-C)."""
    value = os.environ.get(CONTROL_ENV)
    if not value:
        return None
    fd = int(value)
    os.set_inheritable(fd, False)  # the cluster's processes must not hold the pipe open after the demo ends
    _die_with(int(os.environ[PARENT_ENV]))
    return fd


def _die_with(parent: int) -> None:
    """Get SIGTERM (a clean stop) when `parent` dies, even by SIGKILL (Linux `PR_SET_PDEATHSIG`)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


class _Stopping:
    """Where the first SIGINT/SIGTERM goes: KeyboardInterrupt while the demo runs its steps, or the event a kept
    demo's relays wait on (set from the signal handler through the loop, so no exception lands inside asyncio)."""

    loop: asyncio.AbstractEventLoop | None = None
    event: asyncio.Event | None = None


_STOPPING = _Stopping()


def stop_on_signals() -> None:
    """The first SIGINT or SIGTERM stops the demo; later ones are ignored, so that nothing interrupts the cluster's
    teardown."""

    def stop(signum: int, frame: object) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        loop, event = _STOPPING.loop, _STOPPING.event
        if loop is not None and event is not None:
            loop.call_soon_threadsafe(event.set)
            return
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)


async def publish_inside(kept: Kept, targets: Mapping[str, publish.Target], control: int) -> None:
    """Relay the services' unix sockets, tell the process outside where they are, and serve until a signal
    (`stop_on_signals`) says stop."""
    _STOPPING.loop, _STOPPING.event = asyncio.get_running_loop(), asyncio.Event()
    relays: publish.Relays | None = None
    try:
        relays = await publish.serve_inner(targets, Path(kept.workdir) / "publish")
        message = Kept(**{**asdict(kept), "sockets": {name: str(path) for name, path in relays.paths.items()}})
        sys.stdout.flush()  # everything the demo printed comes before what the process outside prints
        os.write(control, (json.dumps(asdict(message)) + "\n").encode())
        os.close(control)
        await _STOPPING.event.wait()
    finally:
        _STOPPING.loop = _STOPPING.event = None
        if relays is not None:
            await relays.close()


# ----------------------------------------------------------------------------------------------------- outside


def _read_message(fd: int) -> Kept | None:
    """One line from the demo (None when it ended without keeping anything running)."""
    with os.fdopen(fd, "rb", closefd=False) as pipe:
        line = pipe.readline()
    return Kept(**json.loads(line)) if line.strip() else None


def _host_kubeconfig(kept: Kept, server: str) -> Path:
    """A copy of the demo's kubeconfig that talks to the published API server (mode 0600: it holds a key). The
    API server's certificate names 127.0.0.1, so TLS verifies as it does inside."""
    config = yaml.safe_load(Path(kept.kubeconfig).read_text())
    for cluster in config.get("clusters", []):
        cluster["cluster"]["server"] = server
    path = Path(kept.workdir) / "kubeconfig"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
    return path


def kubectl_path() -> str:
    """The built kubectl (any kubectl works with the kubeconfig; this one is the cluster's version)."""
    try:
        return str(build.binary("kubectl"))
    except build.BuildError:
        return "kubectl"


def write_access(kept: Kept, router: str, prometheus: str, apiserver: str, kubeconfig: Path) -> Access:
    """The addresses a user types, and an env file that exports them (`source` it)."""
    env_file = Path(kept.workdir) / "env"
    kubectl = Path(kubectl_path())
    lines = [
        f"export KUBECONFIG={shlex.quote(str(kubeconfig))}",
        *([f'export PATH={shlex.quote(str(kubectl.parent))}:"$PATH"'] if kubectl.is_absolute() else []),
        f"export OPENAI_BASE_URL={router}/v1",
        "export OPENAI_API_KEY=${OPENAI_API_KEY:-unused}",
        f"export PDSERVE_PROMETHEUS_URL={prometheus}",
    ]
    env_file.write_text("\n".join(lines) + "\n")
    return Access(router, prometheus, apiserver, str(kubeconfig), str(env_file))


def published_access(kept: Kept, published: publish.Relays) -> Access:
    """The published addresses, with a kubeconfig for the published API server."""
    apiserver = published.url("apiserver", "https")
    kubeconfig = _host_kubeconfig(kept, apiserver)
    return write_access(kept, published.url("router"), published.url("prometheus"), apiserver, kubeconfig)


def banner(kept: Kept, access: Access, kubectl: str, local: bool = False) -> str:
    """What the user reads at the end of a kept demo: addresses that work where they type them."""
    where = (
        "in this network namespace" if local else "in its own network namespace; published on this machine's loopback"
    )
    body = json.dumps({"model": kept.model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16})
    return "\n".join(
        [
            f"Kept running {where}:",
            f"  OpenAI API (router)  {access.router}/v1  (model {kept.model})",
            f"  Prometheus           {access.prometheus}",
            f"  Kubernetes API       {access.apiserver}",
            "From another shell (or `source " + access.env_file + "`):",
            f"  export KUBECONFIG={shlex.quote(access.kubeconfig)}",
            f"  {shlex.quote(kubectl)} get pds -n {kept.namespace} -o wide",
            f"  curl -s {access.router}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'",
            f"The operator's log: {kept.operator_logs}",
            "Ctrl-C stops everything.",
        ]
    )


async def _outside(child: subprocess.Popen[bytes], control: int, echo: Callable[[str], None]) -> int:
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()

    def on_signal() -> None:
        if not stopping.is_set():
            stopping.set()
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signal.SIGTERM)

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal)
    exited = asyncio.ensure_future(asyncio.to_thread(child.wait))
    message = asyncio.ensure_future(asyncio.to_thread(_read_message, control))
    published: publish.Relays | None = None
    try:
        await asyncio.wait({exited, message}, return_when=asyncio.FIRST_COMPLETED)
        kept = await message  # None when the demo ended without keeping anything (its end closed the pipe)
        if kept is not None and not exited.done() and not stopping.is_set():
            published = await publish.serve_outer({name: Path(path) for name, path in kept.sockets.items()})
            echo(banner(kept, published_access(kept, published), kubectl_path()))
            status = await exited
            echo(f"Stopped. The demo's files (logs, kubeconfig) stay in {kept.workdir}")
            return status
        return await exited
    finally:
        if published is not None:
            await published.close()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


def run_isolated(argv: list[str], echo: Callable[[str], None]) -> int:
    """Run the demo command `argv` in a fresh network namespace and publish what it keeps running; returns its
    exit status."""
    read_fd, write_fd = os.pipe()
    env = {**os.environ, CONTROL_ENV: str(write_fd), PARENT_ENV: str(os.getpid())}
    try:
        # A session of its own: the terminal's Ctrl-C reaches this process only, which passes on one SIGTERM;
        # a second signal straight from the terminal could interrupt the demo's teardown of its cluster.
        child = subprocess.Popen(netns.fresh_command(argv), env=env, pass_fds=(write_fd,), start_new_session=True)
    finally:
        os.close(write_fd)
    try:
        return asyncio.run(_outside(child, read_fd, echo))
    finally:
        os.close(read_fd)
