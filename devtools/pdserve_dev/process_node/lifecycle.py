"""Container lifecycle hooks (`preStop`) and the kubelet's grace-period arithmetic around them.

What the kubelet does when it kills a container of a deleted pod (`kuberuntime_container.go`, `killContainer`):

1. run the `preStop` hook, if any, waiting for it at most the whole grace period (a hook that does not finish in
   time is abandoned); a failed hook is reported as a `FailedPreStopHook` event and the kill goes on;
2. take the hook's run time, in whole seconds, off the grace period, but leave the container at least 2 s
   (`minimumGracePeriodInSeconds`) between SIGTERM and SIGKILL;
3. SIGTERM, then SIGKILL when that time is up.

Handlers: `sleep` (the sleep action), `exec` (the process node has no container filesystem: the command runs on the
host with the container's environment and working folder, like a `passthrough` image rule; the usual `sleep` or
`sh` are there) and `httpGet` (to the pod IP unless `host` says otherwise; 200-399 is success, as for probes).
"""

from __future__ import annotations

import http.client
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pdserve_dev.process_node.probes import http_get

Obj = dict[str, Any]

#: The kubelet's minimumGracePeriodInSeconds: SIGTERM always gets this long before SIGKILL.
MINIMUM_GRACE_SECONDS = 2.0


def grace_after_hook(grace: float, hook_seconds: float) -> float:
    """What is left of the grace period for SIGTERM after a hook that ran `hook_seconds` (pure)."""
    return max(grace - int(hook_seconds), MINIMUM_GRACE_SECONDS)


def run_hook(
    handler: Obj, *, container: Obj, pod_ip: str, env: Mapping[str, str], cwd: Path, timeout: float
) -> tuple[bool, str]:
    """Run one lifecycle handler for at most `timeout` seconds; (success, why it failed)."""
    if "sleep" in handler:
        time.sleep(max(0.0, min(float(handler["sleep"].get("seconds", 0)), timeout)))
        return True, ""
    if "exec" in handler:
        command = [str(word) for word in handler["exec"].get("command") or []]
        if not command:
            return False, "exec hook without a command"
        try:
            done = subprocess.run(
                command,
                env=dict(env),
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=max(timeout, 0.0),
                check=False,
            )
        except subprocess.TimeoutExpired:
            return False, f"exec hook {command!r} did not finish within {timeout:.0f}s"
        except OSError as exc:
            return False, f"exec hook {command!r} failed to start: {exc}"
        if done.returncode != 0:
            output = (done.stdout + done.stderr).decode(errors="replace").strip()[-500:]
            return False, f"exec hook {command!r} exited {done.returncode}: {output}"
        return True, ""
    if "httpGet" in handler:
        try:
            return http_get(handler["httpGet"], container, pod_ip, max(timeout, 0.001))
        except (OSError, ValueError, http.client.HTTPException) as exc:
            return False, f"{type(exc).__name__}: {exc}"
    return False, f"unsupported hook handler {sorted(handler)}"
