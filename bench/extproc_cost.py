"""What one ext_proc message costs pdserve's picker, against the floor of Python gRPC itself (issue 22).

Run: ``.venv/bin/python bench/extproc_cost.py [--streams 16] [--messages 2000]``

Behind a GIE gateway (response bodies ``FULL_DUPLEX_STREAMED``) every SSE chunk of every response is a gRPC round
trip through the endpoint picker: Envoy sends the chunk, the picker sends it back. This measures the picker
process's CPU per such message (user+sys from /proc, over ``--streams`` concurrent streams of ``--messages``
response-body chunks each, a loopback gRPC client in this process), for two servers measured in the same run:

- ``picker``: the product's `PickerApp` (its `EndpointPicker.process` handler, its gRPC options);
- ``grpc-floor``: a `grpc.aio` server whose handler answers every message with one prebuilt response: what any
  Python ext_proc server pays before doing anything.

The ratio picker / floor says how much of the cost is pdserve's own code; the floor itself, times the chunks of a
response (65 at 64 output tokens), is what a Python picker spends per request whatever it does, beside the
router's whole per-request CPU (`bench/router_bench.py --scenario gateway` measures both paths end to end).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
CHUNK = b'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":" token"}]}\n\n'
SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"

SERVER = r"""
import asyncio, sys
import grpc
from pdserve.api.router_config import RouterConfig
from pdserve_runtime.gateway.proto import ext_proc_pb2 as pb
from pdserve_runtime.gateway.server import PickerApp

async def floor():
    answer = pb.ProcessingResponse(response_body=pb.BodyResponse())

    async def process(requests, context):
        async for _ in requests:
            yield answer

    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(
        process, request_deserializer=pb.ProcessingRequest.FromString,
        response_serializer=pb.ProcessingResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(sys.argv[2], {"Process": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()

async def picker():
    config = RouterConfig(served_model_name="m", discovery="static", static_decode=["http://127.0.0.1:9"])
    app = PickerApp(config)
    port = await app.start("127.0.0.1", 0, 0, metrics_port=0)
    print(port, flush=True)
    await asyncio.Event().wait()

asyncio.run(floor() if sys.argv[1] == "grpc-floor" else picker())
"""


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(port: int, pid: int, streams: int, messages: int) -> float:
    """Server CPU microseconds per response-body message."""
    from pdserve_runtime.gateway.proto import ext_proc_pb2 as pb

    message = pb.ProcessingRequest(response_body=pb.HttpBody(body=CHUNK, end_of_stream=False))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        method = channel.stream_stream(
            f"/{SERVICE}/Process",
            request_serializer=pb.ProcessingRequest.SerializeToString,
            response_deserializer=pb.ProcessingResponse.FromString,
        )

        async def stream(count: int) -> None:
            call = method()
            for _ in range(count):
                await call.write(message)
                await call.read()
            await call.done_writing()

        await stream(200)  # warm: connection, handler, caches
        before = cpu_seconds(pid)
        await asyncio.gather(*(stream(messages) for _ in range(streams)))
        used = cpu_seconds(pid) - before
    return 1e6 * used / (streams * messages)


def run(kind: str, streams: int, messages: int) -> float:
    """Start the server `kind` in a process of its own, measure it, stop it."""
    command = [sys.executable, "-c", SERVER, kind, SERVICE]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert server.stdout is not None
        return asyncio.run(measure(int(server.stdout.readline()), server.pid, streams, messages))
    finally:
        server.kill()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--chunks-per-request", type=int, default=65)
    args = parser.parse_args()
    started = time.perf_counter()
    floor = run("grpc-floor", args.streams, args.messages)
    picker = run("picker", args.streams, args.messages)
    print(f"grpc-floor: {floor:.1f} us of server CPU per message")
    print(f"picker:     {picker:.1f} us per message (x{picker / floor:.2f} of the floor)")
    print(
        f"per request of {args.chunks_per_request} response chunks: floor {floor * args.chunks_per_request / 1000:.2f}"
        f" ms, picker {picker * args.chunks_per_request / 1000:.2f} ms of picker CPU"
        f" ({time.perf_counter() - started:.0f} s)"
    )


if __name__ == "__main__":
    main()
