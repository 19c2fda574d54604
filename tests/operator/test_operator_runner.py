"""The runner's one ApiClient against a real HTTP server: every thread that can be in a request at once gets a
kept connection.

An operator with the library's default pool (5 connections per CPU: 10 on the two-core machine) and 4 workers plus
8 apply threads threw away and re-opened a TLS connection for every request beyond the tenth while the API was
busiest (the "Connection pool is full, discarding connection" warnings seen in the operator benchmark). Here a
loopback server holds every request until all of them have arrived, so they are truly concurrent, then answers;
urllib3 logs the warning for each connection it has to discard.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from pdserve.api.settings import OperatorSettings
from pdserve_operator.kube import KubeApi
from pdserve_operator.runner import APPLY_THREADS, api_client


class _Barrier(BaseHTTPRequestHandler):
    """Answers `{}` once `server.barrier` has as many waiting requests as it expects (or after 10 s)."""

    protocol_version = "HTTP/1.1"  # keep-alive, as the API server does: connections go back to the pool

    def do_PATCH(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        barrier: threading.Barrier = self.server.barrier  # type: ignore[attr-defined]
        # A broken barrier (not all requests arrived) still answers: the test asserts on `broken`.
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(timeout=10)
        body = json.dumps({"kind": "Status"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[ThreadingHTTPServer]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Barrier)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


def kubeconfig(path: Path, port: int) -> Path:
    document = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    path.write_text(yaml.safe_dump(document))
    return path


def test_every_concurrent_request_keeps_its_connection(
    server: ThreadingHTTPServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    options = OperatorSettings(kubeconfig=str(kubeconfig(tmp_path / "kubeconfig", server.server_address[1])))
    concurrent = options.workers + APPLY_THREADS + 1  # every reconcile and apply thread, and the Lease
    server.barrier = threading.Barrier(concurrent)  # type: ignore[attr-defined]
    api = KubeApi(api_client(options))
    status = {"status": {"observedGeneration": 1}}
    caplog.set_level(logging.WARNING, logger="urllib3.connectionpool")
    with ThreadPoolExecutor(concurrent) as pool:
        answers = list(pool.map(lambda i: api.patch_status("default", f"p{i}", status), range(concurrent)))
    assert answers == [{"kind": "Status"}] * concurrent
    assert not server.barrier.broken, "the requests never were in flight together"  # type: ignore[attr-defined]
    discarded = [r.getMessage() for r in caplog.records if "Connection pool is full" in r.getMessage()]
    assert discarded == []
