"""The real-engine launcher asks Linux for the AMX tile state in every process vLLM starts (the workaround in
`pdserve_dev/realvllm/vllm_launcher.py`, `_request_amx_permission`): without it, on a CPU with AMX, vLLM 0.32's CPU
attention killed its worker with SIGILL on the first request of a short prompt, and every test of the real-engine
cluster module failed (a fresh-clone run on an Intel Sapphire Rapids class machine, 2026-12-03).

A process vLLM spawns re-imports the launcher as `__mp_main__`; this test does the same in the engine's interpreter,
then reads the process's permitted extended states (`arch_prctl(ARCH_GET_XCOMP_PERM)`).
"""

from __future__ import annotations

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
