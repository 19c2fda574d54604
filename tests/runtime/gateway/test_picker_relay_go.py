"""pdserve-picker-relay's own Go tests (`runtime/picker-relay/relay_test.go`), run as part of the suite.

They drive the relay and its link together between a client in Envoy's place and a fake picker speaking the link's
frames; the Python side of the link is tested against the same frames in `test_link.py`. Built with the shared Go
caches (`cluster.build.go_env`), read-only modules as `pdserve_dev.relay` builds the binary: warm, the run takes a
few seconds; a cold build cache compiles grpc and go-control-plane first.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from pdserve_dev import relay
from pdserve_dev.cluster import build

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

_GO_TIMEOUT = 200.0


@pytest.mark.skipif(shutil.which("go") is None, reason="needs the Go toolchain (`go` on PATH)")
def test_the_relays_go_tests_pass() -> None:
    env = {**build.go_env(), "GOFLAGS": "-mod=readonly -buildvcs=false"}
    command = ["go", "test", "-count=1", "-timeout=120s", "./..."]
    try:
        proc = subprocess.run(
            command, cwd=relay.SOURCE, env=env, capture_output=True, text=True, timeout=_GO_TIMEOUT, check=False
        )
    except subprocess.TimeoutExpired as exc:
        # TimeoutExpired keeps what was read as bytes even in text mode.
        output = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        pytest.fail(f"`go test` in {relay.SOURCE} ran past {_GO_TIMEOUT:.0f} s:\n{output}")
    assert proc.returncode == 0, (
        f"`go test` in {relay.SOURCE} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    )
