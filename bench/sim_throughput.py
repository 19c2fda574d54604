"""Benchmark: can one ``pdserve sim --fast`` process sustain >= 500 concurrent streams and >= 20,000
streamed tokens/s on one core?

Run: ``.venv/bin/python bench/sim_throughput.py [--streams 500] [--tokens 200] [--seconds 10]``

Three processes: the server under test (pinned to CPU 0), and a load generator in its own process (pinned
to CPU 1) that keeps ``--streams`` streaming completions open at all times and counts streamed tokens. The
same load runs first against a baseline: a trivial aiohttp SSE server (same chunk format, no engine, no
parsing, no metrics) on the same core, so the sim's figures are printed as ratios to what aiohttp alone
achieves on this machine at this moment. The exit status is 0 when the floor is met.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
FLOOR_STREAMS = 500
FLOOR_TOKENS_PER_S = 20_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pin(pid: int, cpu: int) -> None:
    """Pin a process to one CPU (right after it started, before it spawns threads)."""
    with contextlib.suppress(OSError, AttributeError):
        if cpu < (os.cpu_count() or 1):
            os.sched_setaffinity(pid, {cpu})


# --------------------------------------------------------------------------------------------------------
# Baseline server: aiohttp streaming fixed chunks, nothing else.


def serve_baseline(port: int) -> None:
    import uvloop
    from aiohttp import web

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = int(body.get("max_tokens", 16))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        head = 'data: {"id":"cmpl-x","object":"text_completion","created":0,"model":"m","choices":[{"index":0,"text":"'
        for i in range(n):
            await resp.write((head + ' word","logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n').encode())
            if i % 8 == 7:
                await asyncio.sleep(0)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.add_routes([web.post("/v1/completions", handler), web.get("/health", health)])
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None, backlog=4096)


# --------------------------------------------------------------------------------------------------------
# Load generator: keeps N streams open, counts tokens.


async def _loadgen(url: str, streams: int, tokens: int, seconds: float, warmup: float) -> dict[str, Any]:
    import aiohttp

    counted = 0
    completed = 0
    errors = 0
    counting = False
    stop = False
    body = json.dumps({"model": "sim-model", "prompt": "hello world " * 16, "max_tokens": tokens, "stream": True})
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    ttfts: list[float] = []

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal counted, completed, errors
        marker = b'"text":"'
        while not stop:
            try:
                t0 = time.perf_counter()
                first = True
                async with session.post(
                    url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
                ) as resp:
                    if resp.status != 200:
                        errors += 1
                        await resp.read()
                        continue
                    async for chunk in resp.content.iter_any():
                        if first:
                            if counting:
                                ttfts.append(time.perf_counter() - t0)
                            first = False
                        if counting:
                            counted += chunk.count(marker)
                if counting:
                    completed += 1
            except (TimeoutError, aiohttp.ClientError):
                errors += 1
                await asyncio.sleep(0.05)

    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as session:
        tasks = [asyncio.create_task(worker(session)) for _ in range(streams)]
        await asyncio.sleep(warmup)
        counting = True
        print("start", flush=True)
        t0 = time.perf_counter()
        await asyncio.sleep(seconds)
        counting = False
        elapsed = time.perf_counter() - t0
        print("end", flush=True)
        stop = True
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    ttfts.sort()
    return {
        "tokens_per_s": counted / elapsed,
        "requests_per_s": completed / elapsed,
        "errors": errors,
        "streams": streams,
        "ttft_p50_ms": 1000 * ttfts[len(ttfts) // 2] if ttfts else None,
        "ttft_p99_ms": 1000 * ttfts[int(len(ttfts) * 0.99)] if ttfts else None,
    }


def loadgen_main(url: str, streams: int, tokens: int, seconds: float, warmup: float) -> None:
    import uvloop

    uvloop.install()
    result = asyncio.run(_loadgen(url, streams, tokens, seconds, warmup))
    print(json.dumps(result), flush=True)


# --------------------------------------------------------------------------------------------------------
# Orchestration


def _wait_health(url: str, timeout: float = 20) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(url)
        time.sleep(0.1)


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _run_against(server_cmd: list[str], port: int, args: argparse.Namespace) -> dict[str, Any]:
    server = subprocess.Popen(server_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _pin(server.pid, 0)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_health(url)
        loadgen = subprocess.Popen(
            [PY, __file__, "--loadgen", url, "--streams", str(args.streams), "--tokens", str(args.tokens),
             "--seconds", str(args.seconds), "--warmup", str(args.warmup)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        _pin(loadgen.pid, 1)
        assert loadgen.stdout is not None
        # The load generator prints "start" and "end" around its measured window; sample server CPU there.
        cpu0 = t0 = 0.0
        cpu1 = t1 = 0.0
        result: dict[str, Any] = {}
        for line in loadgen.stdout:
            word = line.strip()
            if word == "start":
                cpu0, t0 = _cpu_seconds(server.pid), time.monotonic()
            elif word == "end":
                cpu1, t1 = _cpu_seconds(server.pid), time.monotonic()
            elif word.startswith("{"):
                result = json.loads(word)
        if loadgen.wait() != 0 or not result:
            raise RuntimeError("the load generator failed")
        wall = t1 - t0
        share = (cpu1 - cpu0) / wall
        result["server_cpu_share"] = share
        # Tokens per second of server CPU: what one fully busy core would stream. When the load generator
        # saturates its own core first (server share < 1), tokens_per_s understates the server's capacity.
        result["tokens_per_server_cpu_s"] = result["tokens_per_s"] / max(share, 1e-9)
        return result
    finally:
        server.terminate()
        try:
            server.wait(5)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=FLOOR_STREAMS)
    parser.add_argument("--tokens", type=int, default=200, help="max_tokens per request")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--loadgen", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--baseline-server", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--skip-baseline", action="store_true")
    args = parser.parse_args()
    if args.loadgen:
        loadgen_main(args.loadgen, args.streams, args.tokens, args.seconds, args.warmup)
        return 0
    if args.baseline_server:
        serve_baseline(args.baseline_server)
        return 0

    print(f"Load: {args.streams} concurrent streams, max_tokens={args.tokens}, {args.seconds}s measured")
    baseline: dict[str, Any] | None = None
    if not args.skip_baseline:
        port = _free_port()
        baseline = _run_against([PY, __file__, "--baseline-server", str(port)], port, args)
        print(f"baseline aiohttp SSE: {json.dumps(baseline)}")
    port = _free_port()
    sim_cmd = [PY, "-m", "pdserve_runtime.sim", "--fast", "--host", "127.0.0.1", "--port", str(port),
               "--side-channel-port", "0", "--log-level", "warning"]  # fmt: skip
    sim = _run_against(sim_cmd, port, args)
    print(f"pdserve sim --fast:   {json.dumps(sim)}")
    tps = sim["tokens_per_s"]
    ok = tps >= FLOOR_TOKENS_PER_S and args.streams >= FLOOR_STREAMS and sim["errors"] == 0
    print(f"sim tokens/s = {tps:,.0f} (floor {FLOOR_TOKENS_PER_S:,}); streams = {args.streams} (floor {FLOOR_STREAMS})")
    if baseline:
        print(
            f"ratio sim/baseline: tokens/s {tps / baseline['tokens_per_s']:.2f}, "
            f"requests/s {sim['requests_per_s'] / max(baseline['requests_per_s'], 1e-9):.2f}, "
            f"tokens per server CPU-second {sim['tokens_per_server_cpu_s'] / baseline['tokens_per_server_cpu_s']:.2f}"
        )
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
