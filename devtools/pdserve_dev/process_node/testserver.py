"""A tiny HTTP server for process-node tests (image ``pdserve-test/http``).

It binds ``PDSERVE_BIND_HOST`` (the pod IP the process node assigns) on ``--port`` and serves:

* ``GET /``        -> JSON ``{"pod": POD_NAME or HOSTNAME, "ip": ..., "port": ...}``, so a test can tell which
  pod answered;
* ``GET /healthz`` -> 200 while healthy, 500 after ``POST /health?ok=false`` (for liveness probes);
* ``GET /readyz``  -> 200 while ready, 503 after ``POST /ready?ok=false`` (for readiness probes);
* ``POST /exit?code=N`` -> the process exits with code N.

``--exit-after SECONDS`` with ``--exit-code N`` makes it exit on its own (a crashing container). It stops
cleanly on SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from urllib.parse import parse_qs, urlparse


class _State:
    healthy = True
    ready = True


class _Handler(BaseHTTPRequestHandler):
    server_version = "pdserve-testserver"

    def _reply(self, code: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        path = urlparse(self.path).path
        if path == "/healthz":
            self._reply(200 if _State.healthy else 500, {"healthy": _State.healthy})
        elif path == "/readyz":
            self._reply(200 if _State.ready else 503, {"ready": _State.ready})
        elif path == "/":
            address = self.server.server_address
            host, port = (address[0], address[1]) if isinstance(address, tuple) else (str(address), 0)
            pod = os.environ.get("POD_NAME") or os.environ.get("HOSTNAME", "")
            self._reply(200, {"pod": pod, "ip": host, "port": port})
        else:
            self._reply(404, {"error": f"no route {path}"})

    def do_POST(self) -> None:
        url = urlparse(self.path)
        query = {key: values[-1] for key, values in parse_qs(url.query).items()}
        ok = query.get("ok", "true").lower() == "true"
        if url.path == "/ready":
            _State.ready = ok
            self._reply(200, {"ready": ok})
        elif url.path == "/health":
            _State.healthy = ok
            self._reply(200, {"healthy": ok})
        elif url.path == "/exit":
            code = int(query.get("code", "0"))
            self._reply(200, {"exiting": code})
            self.wfile.flush()
            os._exit(code)
        else:
            self._reply(404, {"error": f"no route {url.path}"})

    def log_message(self, format: str, *args: object) -> None:
        # Probes hit the server every second; keep the container log for what matters.
        if not self.path.startswith(("/healthz", "/readyz")):
            sys.stderr.write("testserver: " + format % args + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8080")))
    parser.add_argument("--host", default=os.environ.get("PDSERVE_BIND_HOST", "127.0.0.1"))
    parser.add_argument("--exit-after", type=float, default=None, help="Exit on its own after this many s.")
    parser.add_argument("--exit-code", type=int, default=1)
    parser.add_argument("--not-ready", action="store_true", help="Start with /readyz failing.")
    args = parser.parse_args(argv)
    _State.ready = not args.not_ready
    server = ThreadingHTTPServer((args.host, args.port), _Handler)
    server.daemon_threads = True

    def on_term(signum: int, frame: FrameType | None) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, on_term)
    if args.exit_after is not None:
        timer = threading.Timer(args.exit_after, lambda: os._exit(args.exit_code))
        timer.daemon = True
        timer.start()
    print(f"testserver: listening on http://{args.host}:{args.port}", flush=True)
    server.serve_forever(poll_interval=0.2)
    server.server_close()
    print("testserver: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
