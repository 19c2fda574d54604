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


PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip


async def _loadgen(
    url: str, *, streams: int, tokens: int, seconds: float, warmup: float, prefill: str | None = None
) -> dict[str, Any]:
    """Keep ``streams`` streaming requests open against ``url``. With ``prefill``, drive each request
    through KNOWLEDGE.md's PD flow: prefill at ``prefill`` (max_tokens 1), then decode at ``url``."""
    import aiohttp

    counted = 0
    completed = 0
    errors = 0
    counting = False
    stop = False
    request = {"model": "sim-model", "prompt": "hello world " * 16, "max_tokens": tokens, "stream": True}
    body = json.dumps(request)
    prefill_body = json.dumps(dict(request, max_tokens=1, stream=False, kv_transfer_params=PREFILL_PARAMS))
    json_headers = {"Content-Type": "application/json"}
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    ttfts: list[float] = []

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal counted, completed, errors
        marker = b'"text":"'
        while not stop:
            try:
                t0 = time.perf_counter()
                first = True
                data = body
                if prefill is not None:
                    async with session.post(
                        prefill + "/v1/completions", data=prefill_body, headers=json_headers
                    ) as pre:
                        if pre.status != 200:
                            errors += 1
                            await pre.read()
                            continue
                        params = (await pre.json())["kv_transfer_params"]
                    data = json.dumps(dict(request, kv_transfer_params=params))
                async with session.post(url + "/v1/completions", data=data, headers=json_headers) as resp:
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


def loadgen_main(args: argparse.Namespace) -> None:
    import uvloop

    uvloop.install()
    result = asyncio.run(
        _loadgen(
            args.loadgen,
            streams=args.streams,
            tokens=args.tokens,
            seconds=args.seconds,
            warmup=args.warmup,
            prefill=args.loadgen_prefill,
        )
    )
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


def _run_against(
    server_cmds: list[list[str]], url: str, args: argparse.Namespace, prefill: str | None = None
) -> dict[str, Any]:
    """Start the servers (pinned to CPU 0), run the load generator (CPU 1) against ``url``."""
    servers = []
    for cmd in server_cmds:
        server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _pin(server.pid, 0)
        servers.append(server)
    try:
        _wait_health(url)
        if prefill:
            _wait_health(prefill)
        cmd = [PY, __file__, "--loadgen", url, "--streams", str(args.streams), "--tokens", str(args.tokens),
               "--seconds", str(args.seconds), "--warmup", str(args.warmup)]  # fmt: skip
        if prefill:
            cmd += ["--loadgen-prefill", prefill]
        loadgen = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        _pin(loadgen.pid, 1)
        assert loadgen.stdout is not None
        # The load generator prints "start" and "end" around its measured window; sample server CPU there.
        cpu0 = t0 = 0.0
        cpu1 = t1 = 0.0
        result: dict[str, Any] = {}
        for line in loadgen.stdout:
            word = line.strip()
            if word == "start":
                cpu0, t0 = sum(_cpu_seconds(s.pid) for s in servers), time.monotonic()
            elif word == "end":
                cpu1, t1 = sum(_cpu_seconds(s.pid) for s in servers), time.monotonic()
            elif word.startswith("{"):
                result = json.loads(word)
        if loadgen.wait() != 0 or not result:
            raise RuntimeError("the load generator failed")
        share = (cpu1 - cpu0) / (t1 - t0)
        result["server_cpu_share"] = share
        # Tokens per second of server CPU: what one fully busy core would stream. When the load generator
        # saturates its own core first (server share < 1), tokens_per_s understates the server's capacity.
        result["tokens_per_server_cpu_s"] = result["tokens_per_s"] / max(share, 1e-9)
        return result
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            try:
                server.wait(5)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def _sim_cmd(port: int, *extra: str) -> list[str]:
    return [PY, "-m", "pdserve_runtime.sim", "--fast", "--host", "127.0.0.1", "--port", str(port),
            "--side-channel-port", "0", "--log-level", "warning", *extra]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=FLOOR_STREAMS)
    parser.add_argument("--tokens", type=int, default=200, help="max_tokens per request")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--pd", action="store_true", help="also measure the PD flow through a prefill+decode pair")
    parser.add_argument("--loadgen", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--loadgen-prefill", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--baseline-server", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--skip-baseline", action="store_true")
    args = parser.parse_args()
    if args.loadgen:
        loadgen_main(args)
        return 0
    if args.baseline_server:
        serve_baseline(args.baseline_server)
        return 0

    print(f"Load: {args.streams} concurrent streams, max_tokens={args.tokens}, {args.seconds}s measured")
    baseline: dict[str, Any] | None = None
    if not args.skip_baseline:
        port = _free_port()
        baseline = _run_against([[PY, __file__, "--baseline-server", str(port)]], f"http://127.0.0.1:{port}", args)
        print(f"baseline aiohttp SSE: {json.dumps(baseline)}")
    port = _free_port()
    sim = _run_against([_sim_cmd(port)], f"http://127.0.0.1:{port}", args)
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
    if args.pd:
        p_port, d_port = _free_port(), _free_port()
        cmds = [_sim_cmd(p_port, "--role", "prefill"), _sim_cmd(d_port, "--role", "decode")]
        pd = _run_against(cmds, f"http://127.0.0.1:{d_port}", args, prefill=f"http://127.0.0.1:{p_port}")
        print(f"PD pair (3-step flow): {json.dumps(pd)}")
        print(
            f"ratio PD pair/colocated sim: requests/s {pd['requests_per_s'] / max(sim['requests_per_s'], 1e-9):.2f}, "
            f"tokens/s {pd['tokens_per_s'] / max(tps, 1e-9):.2f}"
        )
        ok = ok and pd["errors"] == 0
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
