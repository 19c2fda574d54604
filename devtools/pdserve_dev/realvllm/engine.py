"""One real vLLM engine as a local process on loopback, outside any cluster (for benchmarks).

``with local_engine(port=18000, core=1) as url: ...`` runs ``vllm serve`` of the tiny model with the flags the
real-engine tier uses (``--enforce-eager``, a 256 MiB KV cache, block size 128), pinned to one core
(``VLLM_CPU_OMP_THREADS_BIND``), with its temporary and cache folders in a short private folder (vLLM's unix
sockets live under TMPDIR, and a path over ~107 characters crashes it at start-up). It waits for ``/health`` and
always stops the process group it started (SIGTERM, then SIGKILL), by PID.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from pdserve_dev.realvllm import install, models
from pdserve_dev.realvllm.service import KV_CACHE_BYTES, healthy


class EngineStartError(RuntimeError):
    """The engine exited or did not answer /health in time; the message has its log's tail."""


@contextlib.contextmanager
def local_engine(
    *, port: int, core: int, max_model_len: int = 4096, extra: tuple[str, ...] = (), timeout: float = 600.0
) -> Iterator[str]:
    """Serve the tiny model on 127.0.0.1:`port`, pinned to `core`; yields the base URL."""
    if not install.installed():
        raise EngineStartError(install.missing_message())
    hf_home = models.ensure_models()
    folder = Path(tempfile.mkdtemp(prefix="rv-", dir="/tmp"))
    env = {
        **os.environ,
        "HF_HOME": str(hf_home),
        "HF_HUB_OFFLINE": "1",
        "TMPDIR": str(folder),
        "VLLM_CACHE_ROOT": str(folder / "vllm"),
        "VLLM_CPU_OMP_THREADS_BIND": str(core),
        "PDSERVE_NIXL_PROGRESS_DELAY_US": "100",
        "PYTHONUNBUFFERED": "1",
    }
    argv = [
        str(install.vllm_command()), "serve", models.REPO_ID, "--served-model-name", models.MODEL_NAME,
        "--host", "127.0.0.1", "--port", str(port), "--block-size", "128", "--enforce-eager",
        "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--max-model-len", str(max_model_len), *extra,
    ]  # fmt: skip
    log_path = folder / "engine.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while not healthy(f"{url}/health"):
            if process.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise EngineStartError(f"vllm serve on port {port} did not become healthy:\n{tail}")
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        shutil.rmtree(folder, ignore_errors=True)
