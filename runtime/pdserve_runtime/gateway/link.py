"""The picker link: the relay's pod-local connection to the picker, ext_proc messages without Python gRPC.

`pdserve-picker-relay` (Go, `runtime/picker-relay/`) serves Envoy's ext_proc streams and hands the picker only the
messages it decides or learns from (request headers and body, response headers). Python's `grpc.aio` would add
about a millisecond of wake-ups to each of them on the time to first token (measured: the pick answered 1.5-3 ms
after its body reached the picker, of which 0.35 ms was the picker's work), so the relay talks to the picker over
this link instead: one loopback TCP connection carrying many streams, each message handled by the same
`PickerStream.handle` the gRPC servicer uses (one protocol handler, one scheduling core), synchronously in the read
callback, its answers written at once.

Frames, both ways: stream id (uint32, big endian), kind (uint8), payload length (uint32), payload.

    MESSAGE (1)  relay -> picker: a serialized `ProcessingRequest`; picker -> relay: a `ProcessingResponse`
    END     (2)  relay -> picker: the stream is over (Envoy ended it, or the response ended): release its load;
                 picker -> relay: the same stream id back, after the stream's last answer
    ERROR   (3)  picker -> relay: the stream failed (UTF-8 reason); the relay fails Envoy's stream (failure mode)

A MESSAGE longer than `max_frame_bytes` is discarded as it arrives and its stream answered 413 (the body limit's
answer; the connection and its other streams go on). A frame of an unknown kind ends the connection (its streams
are released), as does the connection's loss. The link listens pod-locally (loopback, or the pod's own address
where pods share a network namespace): whoever can reach it decides picks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import Callable
from typing import cast

from pdserve_runtime.gateway.picker import EndpointPicker, PickerStream
from pdserve_runtime.gateway.proto import ext_proc_pb2 as pb

log = logging.getLogger("pdserve.picker.link")

HEADER = struct.Struct(">IBI")
MESSAGE, END, ERROR = 1, 2, 3


def frame(stream_id: int, kind: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(stream_id, kind, len(payload)) + payload


class LinkProtocol(asyncio.Protocol):
    """One relay connection: its streams and the frames not yet complete."""

    def __init__(
        self, picker: EndpointPicker, max_frame_bytes: int, on_lost: Callable[[LinkProtocol], None] | None = None
    ) -> None:
        self.picker = picker
        self.max_frame_bytes = max_frame_bytes
        self.on_lost = on_lost
        self.streams: dict[int, PickerStream] = {}
        self.buffer = bytearray()
        self.skipping = 0  # bytes of a frame over the limit still to discard
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)  # uvloop's transports do not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        view = memoryview(self.buffer)
        offset, out = 0, bytearray()
        try:
            while True:
                if self.skipping:  # the rest of a frame too long to read
                    skipped = min(self.skipping, len(view) - offset)
                    offset += skipped
                    self.skipping -= skipped
                    if self.skipping:
                        break
                if len(view) - offset < HEADER.size:
                    break
                stream_id, kind, length = HEADER.unpack_from(view, offset)
                if kind not in (MESSAGE, END):
                    log.warning("Closing a picker link: frame of kind %d and %d bytes", kind, length)
                    self.abort()
                    return
                if length > self.max_frame_bytes:
                    # One request too large for the link is that request's 413, not every stream's loss.
                    offset += HEADER.size
                    self.skipping = length
                    out += self._too_large(stream_id)
                    continue
                end = offset + HEADER.size + length
                if len(view) < end:
                    break
                payload = bytes(view[offset + HEADER.size : end])
                offset = end
                out += self._frame(stream_id, kind, payload)
        finally:
            view.release()
        del self.buffer[:offset]
        if out and self.transport is not None:
            self.transport.write(out)

    def _stream(self, stream_id: int) -> PickerStream:
        stream = self.streams.get(stream_id)
        if stream is None:
            stream = self.streams[stream_id] = PickerStream(self.picker)
        return stream

    def _too_large(self, stream_id: int) -> bytes:
        stream = self._stream(stream_id)
        if stream.refused:
            return b""
        return frame(stream_id, MESSAGE, stream.too_large().SerializeToString())

    def _frame(self, stream_id: int, kind: int, payload: bytes) -> bytes:
        if kind == END:
            stream = self.streams.pop(stream_id, None)
            if stream is not None:
                stream.close()
            return frame(stream_id, END)  # every answer of the stream is written before it
        stream = self._stream(stream_id)
        try:
            answers = stream.handle(pb.ProcessingRequest.FromString(payload))
        except Exception as exc:  # one stream's failure must not end the others'
            log.exception("Picker link stream failed")
            self.streams.pop(stream_id, None)
            stream.close()
            return frame(stream_id, ERROR, f"{type(exc).__name__}: {exc}".encode())
        return b"".join(frame(stream_id, MESSAGE, answer.SerializeToString()) for answer in answers)

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        for stream in self.streams.values():
            stream.close()
        self.streams.clear()
        if self.on_lost is not None:
            self.on_lost(self)


class LinkServer:
    """The picker's loopback listener for the relay."""

    def __init__(self, picker: EndpointPicker, max_frame_bytes: int) -> None:
        self.picker = picker
        self.max_frame_bytes = max_frame_bytes
        self.server: asyncio.Server | None = None
        self.connections: set[LinkProtocol] = set()
        self.port = 0

    def _connection(self) -> LinkProtocol:
        protocol = LinkProtocol(self.picker, self.max_frame_bytes, self.connections.discard)
        self.connections.add(protocol)
        return protocol

    async def start(self, port: int, host: str = "127.0.0.1") -> int:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(self._connection, host, port)
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        """Stop listening and drop the relay's connections (their streams release their load)."""
        if self.server is not None:
            self.server.close()
        for connection in list(self.connections):
            connection.abort()
        if self.server is not None:
            with contextlib.suppress(Exception):
                await self.server.wait_closed()
