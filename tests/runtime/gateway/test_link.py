"""The picker's link (`gateway/link.py`) as pdserve-picker-relay uses it: a `PickerApp` with its link on, engines in
static discovery (never contacted: the picker only names them), and a client that writes and reads the frames
itself, from the layout the link documents (stream id uint32 BE | kind uint8 | length uint32 BE | payload).

What the relay relies on: answers carry the pick; END is answered with END after the stream's answers and releases
the request's load; a frame the link refuses ends the connection and releases its streams; one stream's failure is
an ERROR frame for that stream alone.
"""

from __future__ import annotations

import asyncio
import itertools
import struct
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

import pytest
from google.protobuf.struct_pb2 import Struct

from pdserve.api.router_config import PickerConfig, RouterConfig
from pdserve_dev.testing.net import free_ports
from pdserve_dev.testing.wait import wait_for_async
from pdserve_runtime.gateway import link
from pdserve_runtime.gateway.picker import PickerStream
from pdserve_runtime.gateway.proto import ext_proc_pb2 as pb
from pdserve_runtime.gateway.server import PickerApp

pytestmark = pytest.mark.timeout(30)

HEADER = struct.Struct(">IBI")
MESSAGE, END, ERROR = 1, 2, 3
DECODES = ("10.0.0.7", "10.0.0.8")
TARGET_PORT = 8100
BODY_LIMIT = 4096
FRAME_LIMIT = BODY_LIMIT + 64 * 1024  # PickerApp's: the body limit and room for the message around it
COMPLETION = b'{"model":"m","prompt":"Say hi.","max_tokens":8}'
WAIT = 5.0


@dataclass(frozen=True)
class Frame:
    stream: int
    kind: int
    payload: bytes = b""

    def answer(self) -> pb.ProcessingResponse:
        assert self.kind == MESSAGE, f"stream {self.stream}: a frame of kind {self.kind} ({self.payload!r})"
        return pb.ProcessingResponse.FromString(self.payload)


def encode(stream: int, kind: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(stream, kind, len(payload)) + payload


def message(stream: int, request: pb.ProcessingRequest) -> bytes:
    return encode(stream, MESSAGE, request.SerializeToString())


class Relay:
    """One link connection, written and read as the Go relay does."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def write(self, *frames: bytes) -> None:
        self.writer.write(b"".join(frames))
        await self.writer.drain()

    async def frame(self) -> Frame:
        header = await asyncio.wait_for(self.reader.readexactly(HEADER.size), WAIT)
        stream, kind, length = HEADER.unpack(header)
        return Frame(stream, kind, await asyncio.wait_for(self.reader.readexactly(length), WAIT))

    async def frames(self, count: int) -> list[Frame]:
        return [await self.frame() for _ in range(count)]

    async def nothing_more(self, within: float = 0.2) -> None:
        """Nothing arrives for a while (the link answered all it had to)."""
        try:
            data = await asyncio.wait_for(self.reader.read(1), within)
        except TimeoutError:
            return
        raise AssertionError(f"the link sent more: {data!r}")

    async def closed(self) -> bool:
        """Whether the link closes this connection (reads reach EOF or a reset)."""
        try:
            data = await asyncio.wait_for(self.reader.read(), WAIT)
        except ConnectionResetError:
            return True
        return data == b""

    def close(self) -> None:
        self.writer.close()


@pytest.fixture
async def app() -> AsyncIterator[PickerApp]:
    grpc_port, link_port = free_ports(2)
    config = RouterConfig(
        served_model_name="m",
        discovery="static",
        static_decode=[f"http://{host}:8000" for host in DECODES],
        static_health_interval_seconds=0.0,
        engine_metrics_interval_seconds=0.0,
        max_request_body_bytes=BODY_LIMIT,
    )
    picker = PickerApp(config, PickerConfig(grpc_port=grpc_port, link_port=link_port, target_port=TARGET_PORT))
    await picker.start("127.0.0.1", grpc_port, 0, metrics_port=0)
    try:
        yield picker
    finally:
        await picker.stop()


async def connect(app: PickerApp) -> Relay:
    reader, writer = await asyncio.open_connection("127.0.0.1", app.settings.link_port)
    return Relay(reader, writer)


@pytest.fixture
async def relay(app: PickerApp) -> AsyncIterator[Relay]:
    connection = await connect(app)
    try:
        yield connection
    finally:
        connection.close()


def request_headers(path: str = "/v1/completions", subset: Iterable[str] = ()) -> pb.ProcessingRequest:
    """Request headers as the relay forwards them: a full-duplex gateway's config with the body mode BUFFERED."""
    headers = pb.HeaderMap(
        headers=[pb.HeaderValue(key=":method", raw_value=b"POST"), pb.HeaderValue(key=":path", raw_value=path.encode())]
    )
    request = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=headers),
        protocol_config=pb.ProtocolConfiguration(
            request_body_mode=pb.BUFFERED, response_body_mode=pb.FULL_DUPLEX_STREAMED
        ),
    )
    if subset:
        hint = Struct()
        hint.update({"x-gateway-destination-endpoint-subset": ",".join(subset)})
        request.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return request


def request_body(body: bytes = COMPLETION, end: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=end))


def request_trailers() -> pb.ProcessingRequest:
    trailers = pb.HeaderMap(headers=[pb.HeaderValue(key="x-body-digest", raw_value=b"0123")])
    return pb.ProcessingRequest(request_trailers=pb.HttpTrailers(trailers=trailers))


def response_headers(status: int = 200) -> pb.ProcessingRequest:
    headers = pb.HeaderMap(headers=[pb.HeaderValue(key=":status", raw_value=str(status).encode())])
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=headers))


def destination(answer: pb.ProcessingResponse) -> str:
    """The pick's `x-gateway-destination-endpoint` (the test fails when the answer is no pick)."""
    assert answer.WhichOneof("response") == "request_headers", answer
    values = [
        option.header.raw_value.decode()
        for option in answer.request_headers.response.header_mutation.set_headers
        if option.header.key == "x-gateway-destination-endpoint"
    ]
    assert len(values) == 1, answer
    return values[0]


def in_flight(app: PickerApp) -> dict[str, int]:
    """Requests in flight by decode engine host."""
    return {state.url.split("//")[1].split(":")[0]: state.in_flight for state in app.core.table.states("decode")}


async def released(app: PickerApp) -> None:
    async def idle() -> bool:
        return not any(in_flight(app).values())

    await wait_for_async(idle, within=WAIT, message=lambda: f"the decode engines' load released: {in_flight(app)}")


async def pick_stream(relay: Relay, stream: int, subset: Iterable[str] = ()) -> str:
    """Headers and body of one completion; returns the pick (checks the body's "continue" after it)."""
    await relay.write(message(stream, request_headers(subset=subset)), message(stream, request_body()))
    pick, body = await relay.frames(2)
    assert (pick.stream, body.stream) == (stream, stream)
    # Told BUFFERED (the relay echoes the body itself), the picker continues the body instead of sending it back.
    assert body.answer() == pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse()))
    return destination(pick.answer())


async def test_a_completion_is_picked_over_the_link_and_end_releases_its_decode_engine(
    app: PickerApp, relay: Relay
) -> None:
    # The headers alone are not answered: the picker waits for the body.
    await relay.write(message(1, request_headers()))
    await relay.nothing_more()
    await relay.write(message(1, request_body()))
    pick, body = await relay.frames(2)
    assert (pick.stream, pick.kind, body.stream, body.kind) == (1, MESSAGE, 1, MESSAGE)
    chosen = destination(pick.answer())
    assert chosen in {f"{host}:{TARGET_PORT}" for host in DECODES}
    assert body.answer().WhichOneof("response") == "request_body"
    host = chosen.split(":")[0]
    assert in_flight(app)[host] == 1

    # Response headers and END in one write: END comes back after the headers' answer, and the load is released.
    await relay.write(message(1, response_headers()), encode(1, END))
    answer, end = await relay.frames(2)
    assert answer.answer() == pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=pb.CommonResponse()))
    assert end == Frame(1, END)
    assert in_flight(app)[host] == 0
    # An END for a stream the link does not hold (already ended, or never opened) is answered all the same.
    await relay.write(encode(1, END))
    assert await relay.frame() == Frame(1, END)


async def test_trailers_end_a_body_and_the_pick_follows_them(app: PickerApp, relay: Relay) -> None:
    """A body that trailers end carries no end_of_stream: the trailers complete it (the pick, the body's continue,
    the trailers' answer, in that order); with no body at all, the pick and the trailers' answer alone."""
    await relay.write(message(7, request_headers()), message(7, request_body(end=False)))
    await relay.nothing_more()
    await relay.write(message(7, request_trailers()))
    pick, body, trailers = await relay.frames(3)
    assert destination(pick.answer()) in {f"{host}:{TARGET_PORT}" for host in DECODES}
    assert body.answer() == pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse()))
    assert trailers.answer().WhichOneof("response") == "request_trailers"
    await relay.write(message(8, request_headers("/v1/models")), message(8, request_trailers()))
    pick, trailers = await relay.frames(2)
    assert pick.answer().WhichOneof("response") == "request_headers"
    assert trailers.answer().WhichOneof("response") == "request_trailers"
    await relay.write(encode(7, END), encode(8, END))
    assert await relay.frames(2) == [Frame(7, END), Frame(8, END)]
    await released(app)


async def test_end_follows_every_answer_written_before_it(app: PickerApp, relay: Relay) -> None:
    await relay.write(
        message(5, request_headers(subset=[f"{DECODES[1]}:{TARGET_PORT}"])), message(5, request_body()), encode(5, END)
    )
    pick, body, end = await relay.frames(3)
    assert destination(pick.answer()) == f"{DECODES[1]}:{TARGET_PORT}"  # the gateway's subset is honoured
    assert body.answer().WhichOneof("response") == "request_body"
    assert end == Frame(5, END)
    assert not any(in_flight(app).values())


async def test_frames_split_across_reads_are_reassembled(app: PickerApp, relay: Relay) -> None:
    first = message(3, request_headers())
    data = first + message(3, request_body())
    # Cut inside the first header, inside the first payload, and inside the second header; the pauses let each
    # piece arrive in a read of its own.
    cuts = [0, 5, 20, len(first) + 4, len(data)]
    for start, stop in itertools.pairwise(cuts):
        await relay.write(data[start:stop])
        await asyncio.sleep(0.02)
    pick, _ = await relay.frames(2)
    assert pick.stream == 3 and destination(pick.answer())


async def test_a_body_over_the_limit_is_refused_by_the_picker_not_the_link(app: PickerApp, relay: Relay) -> None:
    # The frame limit sits above the body limit, so the picker itself answers 413 and the connection stays.
    await relay.write(message(1, request_headers()), message(1, request_body(b"x" * (BODY_LIMIT + 1))))
    refusal = (await relay.frame()).answer()
    assert refusal.immediate_response.status.code == 413
    assert await pick_stream(relay, 2)


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(encode(9, ERROR, b"the relay never sends ERROR"), id="kind-error"),
        pytest.param(encode(9, 7), id="unknown-kind"),
    ],
)
async def test_a_frame_the_link_refuses_closes_the_connection_and_releases_its_streams(
    app: PickerApp, relay: Relay, bad: bytes
) -> None:
    first = await pick_stream(relay, 1)
    assert in_flight(app)[first.split(":")[0]] == 1
    # Held here, the connection's state outlives it: its streams must be released explicitly, not by collection.
    (connection,) = app.link.connections
    await relay.write(bad)
    assert await relay.closed()
    await released(app)
    assert connection not in app.link.connections
    # The listener is unaffected: the relay's next connection is served.
    again = await connect(app)
    try:
        assert await pick_stream(again, 1)
    finally:
        again.close()


async def test_a_frame_over_the_limit_is_its_streams_413_and_the_connection_goes_on(
    app: PickerApp, relay: Relay
) -> None:
    first = await pick_stream(relay, 1)
    # Stream 2's body frame is one byte over the limit, written in pieces: discarded as it arrives, answered 413.
    oversized = message(2, request_body(b"x" * FRAME_LIMIT))
    await relay.write(message(2, request_headers()))
    for start in range(0, len(oversized), 64 * 1024):
        await relay.write(oversized[start : start + 64 * 1024])
    refusal = await relay.frame()
    assert refusal.stream == 2 and refusal.answer().immediate_response.status.code == 413
    # Stream 1 still holds its engine; a new stream on the same connection is picked.
    assert in_flight(app)[first.split(":")[0]] == 1
    assert await pick_stream(relay, 3)


async def test_a_frame_at_the_limit_is_read(app: PickerApp, relay: Relay) -> None:
    # A MESSAGE of exactly FRAME_LIMIT bytes: not a valid request (the body in it is over the body limit), but the
    # link reads it and the picker answers (one byte more is discarded unread: the test above).
    request = request_body(b"")
    padding = FRAME_LIMIT - len(request.SerializeToString())
    body = request_body(b"x" * padding)
    while len(body.SerializeToString()) > FRAME_LIMIT:  # the length prefix of the body field grows with it
        padding -= 1
        body = request_body(b"x" * padding)
    assert len(body.SerializeToString()) == FRAME_LIMIT
    await relay.write(message(1, request_headers()), message(1, body))
    assert (await relay.frame()).answer().immediate_response.status.code == 413


async def test_a_stream_whose_handling_fails_gets_an_error_frame_and_the_others_go_on(
    app: PickerApp, relay: Relay, monkeypatch: pytest.MonkeyPatch
) -> None:
    handle = PickerStream.handle

    def failing(self: PickerStream, request: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if request.HasField("response_headers") and self.headers.get(":path") == "/v1/completions?fail":
            raise RuntimeError("the picker broke")
        return handle(self, request)

    monkeypatch.setattr(PickerStream, "handle", failing)
    await relay.write(
        message(1, request_headers("/v1/completions?fail")), message(1, request_body()),
        message(2, request_headers()), message(2, request_body()),
    )  # fmt: skip
    frames = await relay.frames(4)
    assert [(f.stream, f.answer().WhichOneof("response")) for f in frames] == [
        (1, "request_headers"), (1, "request_body"), (2, "request_headers"), (2, "request_body"),
    ]  # fmt: skip
    assert sum(in_flight(app).values()) == 2

    # Stream 1 fails on its response headers, in the same write as stream 2's: stream 1 gets ERROR (and its load
    # is released), stream 2 its answer.
    await relay.write(message(1, response_headers()), message(2, response_headers()))
    error, answer = await relay.frames(2)
    assert error == Frame(1, ERROR, b"RuntimeError: the picker broke")
    assert answer.stream == 2 and answer.answer().WhichOneof("response") == "response_headers"
    assert sum(in_flight(app).values()) == 1
    await relay.write(encode(2, END))
    assert await relay.frame() == Frame(2, END)
    assert not any(in_flight(app).values())


async def test_a_malformed_message_fails_its_stream_only(app: PickerApp, relay: Relay) -> None:
    first = await pick_stream(relay, 1)
    # A truncated varint: not a ProcessingRequest. Its stream (the one holding a pick) fails and releases its load.
    await relay.write(encode(1, MESSAGE, b"\x0a\xff"))
    error = await relay.frame()
    assert (error.stream, error.kind) == (1, ERROR)
    assert error.payload.startswith(b"DecodeError"), error.payload
    assert in_flight(app)[first.split(":")[0]] == 0
    # The connection and its other streams go on.
    assert await pick_stream(relay, 2)
    await relay.write(encode(2, END))
    assert await relay.frame() == Frame(2, END)
    assert not any(in_flight(app).values())


async def test_stopping_the_picker_drops_the_relays_connections_and_their_load(app: PickerApp, relay: Relay) -> None:
    await pick_stream(relay, 1)
    await app.link.stop()
    assert await relay.closed()
    assert not any(in_flight(app).values())
    assert not app.link.connections


def test_the_frame_layout_is_the_documented_one() -> None:
    # link.frame is what the Go relay parses (link.go reads the same 9-byte header).
    assert link.frame(0x01020304, END, b"ab") == b"\x01\x02\x03\x04\x02\x00\x00\x00\x02ab"
    assert (link.MESSAGE, link.END, link.ERROR) == (MESSAGE, END, ERROR)
