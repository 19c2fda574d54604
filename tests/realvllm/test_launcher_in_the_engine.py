"""The real-engine launcher's workarounds (`pdserve_dev/realvllm/vllm_launcher.py`), checked in the engine's own
interpreter, where a process vLLM spawns re-imports the launcher as `__mp_main__` (these tests do the same):

- it asks Linux for the AMX tile state in every process vLLM starts (`_request_amx_permission`): without it, on a
  CPU with AMX, vLLM 0.32's CPU attention killed its worker with SIGILL on the first request of a short prompt, and
  every test of the real-engine cluster module failed (a fresh-clone run on an Intel Sapphire Rapids class machine,
  2026-12-03). The test reads the permitted extended states back (`arch_prctl(ARCH_GET_XCOMP_PERM)`);
- with `PDSERVE_VLLM_YIELD_SLEEP_US`, the polling loops of vLLM's shared-memory queues sleep where they yielded the
  CPU (`_sleep_instead_of_yield`): a busy engine's spinning worker starved an engine starting on the same core.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import pytest

from pdserve_dev.realvllm import install

pytestmark = pytest.mark.realvllm

#: x86-64's arch_prctl system call and its extended-state requests (arch/x86/include/uapi/asm/prctl.h).
PROBE = """
import ctypes, runpy, sys
libc = ctypes.CDLL(None, use_errno=True)
def states(request):
    mask = ctypes.c_uint64()
    if libc.syscall(158, request, ctypes.byref(mask)) != 0:
        raise OSError(ctypes.get_errno(), "arch_prctl")
    return mask.value
before = states(0x1022)
runpy.run_path(sys.argv[1], run_name="__mp_main__")
print(states(0x1021), before, states(0x1022))
"""
XTILEDATA = 1 << 18


def test_a_process_vllm_spawns_may_use_amx_tiles(real_vllm: Path) -> None:
    if platform.machine() != "x86_64":
        pytest.skip(f"AMX is an x86-64 extension; this machine is {platform.machine()}")
    proc = subprocess.run(
        [str(install.engine_python()), "-c", PROBE, str(install.vllm_command())],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    supported, before, after = (int(word) for word in proc.stdout.split()[-3:])
    if not supported & XTILEDATA:
        pytest.skip("this CPU (or its kernel) offers no AMX tile state: nothing to ask for")
    assert not before & XTILEDATA, "a fresh process already holds the permission: the test would prove nothing"
    assert after & XTILEDATA, "importing the launcher did not ask for the AMX tile state"


#: Times 200 of the yields vLLM's shared-memory queues make between polls, as that module calls them.
YIELDS = """
import runpy, sys, time
runpy.run_path(sys.argv[1], run_name="__mp_main__")
from vllm.distributed.device_communicators import shm_broadcast
started = time.perf_counter()
for _ in range(200):
    shm_broadcast.sched_yield()
print(time.perf_counter() - started)
"""


@pytest.mark.parametrize(("setting", "at_least", "at_most"), [("500", 0.1, 5.0), (None, 0.0, 0.05)])
def test_vllms_queues_sleep_where_they_yielded_when_the_launcher_is_told(
    real_vllm: Path, setting: str | None, at_least: float, at_most: float
) -> None:
    """200 yields: with 500 us asked for, at least 0.1 s (each a sleep); unset, vLLM's own sched_yield (far less)."""
    env = {key: value for key, value in os.environ.items() if key != "PDSERVE_VLLM_YIELD_SLEEP_US"}
    if setting is not None:
        env["PDSERVE_VLLM_YIELD_SLEEP_US"] = setting
    proc = subprocess.run(
        [str(install.engine_python()), "-c", YIELDS, str(install.vllm_command())],
        capture_output=True, text=True, timeout=180, check=False, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert at_least <= float(proc.stdout.split()[-1]) <= at_most, proc.stdout[-500:]
