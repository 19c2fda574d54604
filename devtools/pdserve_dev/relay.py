"""The picker relay (`runtime/picker-relay/`, Go), built from this checkout for tests, benchmarks and the process node.

The image builds it in the Dockerfile; here it is built with the shared Go caches (`cluster.build.go_env`) into the
project's cache folder, under a key of its sources, so a change of the relay rebuilds it and nothing else does:

    relay/<key>/pdserve-picker-relay

`binary()` builds on first use (seconds warm; a cold module download of grpc and go-control-plane takes a minute or
two); `path()` only says where it will be (the process node's image map names it before anything is built).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

from pdserve_dev.cluster import build

SOURCE = Path(__file__).resolve().parents[2] / "runtime" / "picker-relay"
BINARY = "pdserve-picker-relay"


def _sources() -> list[Path]:
    return sorted(path for path in SOURCE.iterdir() if path.suffix == ".go" or path.name in ("go.mod", "go.sum"))


def cache_key() -> str:
    digest = hashlib.sha256()
    for path in _sources():
        if not path.name.endswith("_test.go"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return f"relay-{digest.hexdigest()[:12]}"


def path() -> Path:
    return build.cache_root() / "relay" / cache_key() / BINARY


def binary(log: Callable[[str], None] = print) -> Path:
    """The relay built from this checkout's sources (built now if it is not yet)."""
    env = {**build.go_env(), "GOFLAGS": "-mod=readonly -buildvcs=false"}
    return build.go_binary(path(), source=SOURCE, what="runtime/picker-relay", env=env, log=log)
