package main

// The relay and the link together, between a gRPC client in Envoy's place (over bufconn) and a fake picker that
// speaks the link's frames on a loopback listener. The fake writes and parses frames itself, from the layout
// link.go documents (not from its constants), so a change of the wire format fails here as it would against
// link.py.

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"log"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/encoding/prototext"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

// The link's wire format as link.go and link.py document it.
const (
	wireMessage = 1
	wireEnd     = 2
	wireError   = 3
	wireHeader  = 4 + 1 + 4 // stream id (uint32 BE) | kind (uint8) | payload length (uint32 BE)
)

// How long a test waits for something that should happen; what should not happen is watched for quietFor.
const (
	waitFor  = 3 * time.Second
	quietFor = 200 * time.Millisecond
)

// -- the fake picker ---------------------------------------------------------------------------------------------

type linkFrame struct {
	id      uint32
	kind    byte
	payload []byte
}

// fakePicker accepts the relay's link connections, hands the test every frame it reads, and writes what the test
// tells it to on the latest connection.
type fakePicker struct {
	listener net.Listener
	frames   chan linkFrame

	mu       sync.Mutex
	conns    []net.Conn
	accepted int
}

func startFakePicker(t *testing.T) *fakePicker {
	t.Helper()
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &fakePicker{listener: listener, frames: make(chan linkFrame, 256)}
	go p.accept()
	t.Cleanup(func() {
		_ = listener.Close()
		p.mu.Lock()
		defer p.mu.Unlock()
		for _, conn := range p.conns {
			_ = conn.Close()
		}
	})
	return p
}

func (p *fakePicker) addr() string { return p.listener.Addr().String() }

func (p *fakePicker) accept() {
	for {
		conn, err := p.listener.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		p.conns = append(p.conns, conn)
		p.accepted++
		p.mu.Unlock()
		go p.read(conn)
	}
}

func (p *fakePicker) read(conn net.Conn) {
	header := make([]byte, wireHeader)
	for {
		if _, err := io.ReadFull(conn, header); err != nil {
			return
		}
		payload := make([]byte, binary.BigEndian.Uint32(header[5:9]))
		if _, err := io.ReadFull(conn, payload); err != nil {
			return
		}
		p.frames <- linkFrame{id: binary.BigEndian.Uint32(header[0:4]), kind: header[4], payload: payload}
	}
}

func (p *fakePicker) connections() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.accepted
}

// next is the next frame the relay sent (the test fails when none comes).
func (p *fakePicker) next(t *testing.T) linkFrame {
	t.Helper()
	select {
	case f := <-p.frames:
		return f
	case <-time.After(waitFor):
		t.Fatal("the picker received no frame")
		return linkFrame{}
	}
}

// quiet fails the test when the relay sends the picker anything for a while.
func (p *fakePicker) quiet(t *testing.T) {
	t.Helper()
	select {
	case f := <-p.frames:
		t.Fatalf("the picker received an unexpected frame: stream %d kind %d %q", f.id, f.kind, f.payload)
	case <-time.After(quietFor):
	}
}

// nextMessage is the next frame, which must be a MESSAGE, as the request it carries.
func (p *fakePicker) nextMessage(t *testing.T) (uint32, *extprocv3.ProcessingRequest) {
	t.Helper()
	f := p.next(t)
	if f.kind != wireMessage {
		t.Fatalf("the picker received a frame of kind %d on stream %d, want a message", f.kind, f.id)
	}
	message := &extprocv3.ProcessingRequest{}
	if err := proto.Unmarshal(f.payload, message); err != nil {
		t.Fatalf("the picker received a message it cannot parse: %v", err)
	}
	return f.id, message
}

// expectEnd checks that the next frame half-closes stream id.
func (p *fakePicker) expectEnd(t *testing.T, id uint32) {
	t.Helper()
	f := p.next(t)
	if f.kind != wireEnd || f.id != id || len(f.payload) != 0 {
		t.Fatalf("the picker received stream %d kind %d %q, want END of stream %d", f.id, f.kind, f.payload, id)
	}
}

// write sends frames to the relay on the latest connection, in one write as link.py does.
func (p *fakePicker) write(t *testing.T, frames ...[]byte) {
	t.Helper()
	p.mu.Lock()
	conn := p.conns[len(p.conns)-1]
	p.mu.Unlock()
	if _, err := conn.Write(bytes.Join(frames, nil)); err != nil {
		t.Fatal(err)
	}
}

func (p *fakePicker) closeConnections() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, conn := range p.conns {
		_ = conn.Close()
	}
}

func rawFrame(id uint32, kind byte, payload []byte) []byte {
	buf := make([]byte, wireHeader+len(payload))
	binary.BigEndian.PutUint32(buf[0:4], id)
	buf[4] = kind
	binary.BigEndian.PutUint32(buf[5:9], uint32(len(payload)))
	copy(buf[wireHeader:], payload)
	return buf
}

func answerFrame(t *testing.T, id uint32, answer *extprocv3.ProcessingResponse) []byte {
	t.Helper()
	payload, err := proto.Marshal(answer)
	if err != nil {
		t.Fatal(err)
	}
	return rawFrame(id, wireMessage, payload)
}

// -- the relay and Envoy's side ----------------------------------------------------------------------------------

// startRelay serves the relay on bufconn, linked to the picker at addr, and returns Envoy's client of it.
func startRelay(t *testing.T, addr string, flushBytes int) extprocv3.ExternalProcessorClient {
	t.Helper()
	listener := bufconn.Listen(1 << 20)
	server := grpc.NewServer()
	extprocv3.RegisterExternalProcessorServer(server, NewRelay(NewLink(addr, 1<<20).Open, flushBytes))
	go func() { _ = server.Serve(listener) }()
	t.Cleanup(server.Stop)
	conn, err := grpc.NewClient("passthrough:///relay",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return listener.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return extprocv3.NewExternalProcessorClient(conn)
}

// envoyStream is one ext_proc stream as Envoy holds it.
type envoyStream struct {
	t      *testing.T
	stream extprocv3.ExternalProcessor_ProcessClient
	cancel context.CancelFunc
}

func openStream(t *testing.T, client extprocv3.ExternalProcessorClient) *envoyStream {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*waitFor) // bounds every Recv of a broken relay
	t.Cleanup(cancel)
	stream, err := client.Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return &envoyStream{t: t, stream: stream, cancel: cancel}
}

func (e *envoyStream) send(messages ...*extprocv3.ProcessingRequest) {
	e.t.Helper()
	for _, message := range messages {
		if err := e.stream.Send(message); err != nil {
			e.t.Fatalf("Envoy's send failed: %v", err)
		}
	}
}

// expect checks that Envoy's next answer is want.
func (e *envoyStream) expect(want *extprocv3.ProcessingResponse) {
	e.t.Helper()
	got, err := e.stream.Recv()
	if err != nil {
		e.t.Fatalf("Envoy received %v, want %s", err, prototext.Format(want))
	}
	if !proto.Equal(got, want) {
		e.t.Fatalf("Envoy received\n%s\nwant\n%s", prototext.Format(got), prototext.Format(want))
	}
}

// rest is every answer Envoy receives until the stream ends, and how it ended (nil: OK).
func (e *envoyStream) rest() ([]*extprocv3.ProcessingResponse, error) {
	var answers []*extprocv3.ProcessingResponse
	for {
		answer, err := e.stream.Recv()
		if err == io.EOF {
			return answers, nil
		}
		if err != nil {
			return answers, err
		}
		answers = append(answers, answer)
	}
}

// failure is how Envoy's stream fails (the test fails when it answers instead).
func (e *envoyStream) failure() error {
	e.t.Helper()
	answer, err := e.stream.Recv()
	if err == nil {
		e.t.Fatalf("Envoy received %s, want the stream to fail", prototext.Format(answer))
	}
	return err
}

func expectAnswers(t *testing.T, got []*extprocv3.ProcessingResponse, want ...*extprocv3.ProcessingResponse) {
	t.Helper()
	same := len(got) == len(want)
	for i := 0; same && i < len(got); i++ {
		same = proto.Equal(got[i], want[i])
	}
	if !same {
		var text strings.Builder
		for _, answer := range got {
			text.WriteString(prototext.Format(answer) + "\n---\n")
		}
		t.Fatalf("Envoy received %d answers:\n%s\nwant %d", len(got), text.String(), len(want))
	}
}

func expectRequest(t *testing.T, got, want *extprocv3.ProcessingRequest) {
	t.Helper()
	if !proto.Equal(got, want) {
		t.Fatalf("the picker received\n%s\nwant\n%s", prototext.Format(got), prototext.Format(want))
	}
}

// -- messages ----------------------------------------------------------------------------------------------------

func modes(request, response filterv3.ProcessingMode_BodySendMode) *extprocv3.ProtocolConfiguration {
	return &extprocv3.ProtocolConfiguration{RequestBodyMode: request, ResponseBodyMode: response}
}

var fullDuplex = modes(filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED)

func headerMap(pairs ...string) *corev3.HeaderMap {
	headers := &corev3.HeaderMap{}
	for i := 0; i < len(pairs); i += 2 {
		headers.Headers = append(headers.Headers, &corev3.HeaderValue{Key: pairs[i], RawValue: []byte(pairs[i+1])})
	}
	return headers
}

func requestHeaders(path string, end bool, config *extprocv3.ProtocolConfiguration) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{
		ProtocolConfig: config,
		Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
			Headers: headerMap(":method", "POST", ":path", path), EndOfStream: end,
		}},
	}
}

func requestBody(chunk string, end bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: []byte(chunk), EndOfStream: end},
	}}
}

func responseHeaders(end bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{
		ResponseHeaders: &extprocv3.HttpHeaders{Headers: headerMap(":status", "200"), EndOfStream: end},
	}}
}

func responseBody(chunk string, end bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
		ResponseBody: &extprocv3.HttpBody{Body: []byte(chunk), EndOfStream: end},
	}}
}

// pick is the picker's answer to the request headers: the destination header, as pdserve's picker sets it.
func pick(destination string) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{
		RequestHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{
			HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{{
				Header: &corev3.HeaderValue{Key: "x-gateway-destination-endpoint", RawValue: []byte(destination)},
			}}},
		}},
	}}
}

// marked answers are continues the test can tell apart (a header removal names each one).
func markedRequestBodyContinue(mark string) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{
		RequestBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{
			HeaderMutation: &extprocv3.HeaderMutation{RemoveHeaders: []string{mark}},
		}},
	}}
}

func markedResponseHeadersContinue(mark string) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{
		ResponseHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{
			HeaderMutation: &extprocv3.HeaderMutation{RemoveHeaders: []string{mark}},
		}},
	}}
}

// What the relay itself answers, written out here rather than taken from relay.go.

func streamed(chunk string, end bool) *extprocv3.BodyResponse {
	return &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{
		Mutation: &extprocv3.BodyMutation_StreamedResponse{
			StreamedResponse: &extprocv3.StreamedBodyResponse{Body: []byte(chunk), EndOfStream: end},
		},
	}}}
}

func requestBodyEcho(body string) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{
		RequestBody: streamed(body, true),
	}}
}

func responseBodyEcho(chunk string, end bool) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{
		ResponseBody: streamed(chunk, end),
	}}
}

func requestTrailers() *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{
		RequestTrailers: &extprocv3.HttpTrailers{Trailers: headerMap("x-body-digest", "0123")},
	}}
}

func trailersContinue() *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{
		RequestTrailers: &extprocv3.TrailersResponse{},
	}}
}

func responseHeadersContinue() *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{
		ResponseHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{}},
	}}
}

func responseBodyContinue() *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{
		ResponseBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{}},
	}}
}

var completionChunks = []string{`{"model":"m",`, `"prompt":"Say hi.",`, `"max_tokens":8}`}

const completion = `{"model":"m","prompt":"Say hi.","max_tokens":8}`

// pickFullDuplex runs a full-duplex request through the pick: headers (with the gateway's subset hint in the
// metadata) and the body in chunks; the picker must see the headers with the body mode BUFFERED and the body in
// one message; after its pick and its "continue" for the body, Envoy must receive the pick and the relay's echo of
// the whole body, and not the continue.
func pickFullDuplex(t *testing.T, picker *fakePicker, envoy *envoyStream) uint32 {
	t.Helper()
	headers := requestHeaders("/v1/completions", false, fullDuplex)
	hint, err := structpb.NewStruct(map[string]any{"x-gateway-destination-endpoint-subset": "10.0.0.7:8100"})
	if err != nil {
		t.Fatal(err)
	}
	headers.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{"envoy.lb.subset_hint": hint}}
	envoy.send(headers)
	for i, chunk := range completionChunks {
		envoy.send(requestBody(chunk, i == len(completionChunks)-1))
	}

	id, seen := picker.nextMessage(t)
	want := proto.Clone(headers).(*extprocv3.ProcessingRequest)
	want.ProtocolConfig.RequestBodyMode = filterv3.ProcessingMode_BUFFERED // the relay owns the body
	expectRequest(t, seen, want)
	bodyID, body := picker.nextMessage(t)
	if bodyID != id {
		t.Fatalf("the body came on stream %d, the headers on %d", bodyID, id)
	}
	expectRequest(t, body, requestBody(completion, true))

	picker.write(t, answerFrame(t, id, pick("10.0.0.7:8100")), answerFrame(t, id, markedRequestBodyContinue("picker")))
	envoy.expect(pick("10.0.0.7:8100"))
	envoy.expect(requestBodyEcho(completion))
	return id
}

// -- (a), (b): full duplex ---------------------------------------------------------------------------------------

func TestFullDuplexRequestBodyReachesThePickerOnceAndIsEchoedAfterThePick(t *testing.T) {
	picker := startFakePicker(t)
	envoy := openStream(t, startRelay(t, picker.addr(), 1<<20))
	id := pickFullDuplex(t, picker, envoy)
	picker.quiet(t) // one body message, nothing after it

	// Envoy ends the stream (a response without a body): the picker's "continue" for the body must not follow.
	envoy.send(responseHeaders(true))
	picker.nextMessage(t)
	picker.expectEnd(t, id)
	picker.write(t, rawFrame(id, wireEnd, nil))
	if err := envoy.stream.CloseSend(); err != nil {
		t.Fatal(err)
	}
	answers, err := envoy.rest()
	if err != nil {
		t.Fatalf("Envoy's stream failed: %v", err)
	}
	expectAnswers(t, answers, responseHeadersContinue())
}

// A full-duplex body that trailers end has no chunk with end_of_stream: the trailers complete it. The picker gets
// the body (end_of_stream unset) before the trailers and picks on them; Envoy gets the pick, the body echoed with
// the stream left open, then the trailers' answer.
func TestFullDuplexTrailersCompleteTheBodyAndFollowItsEcho(t *testing.T) {
	picker := startFakePicker(t)
	envoy := openStream(t, startRelay(t, picker.addr(), 1<<20))
	envoy.send(requestHeaders("/v1/completions", false, fullDuplex))
	for _, chunk := range completionChunks {
		envoy.send(requestBody(chunk, false))
	}
	envoy.send(requestTrailers())

	id, _ := picker.nextMessage(t)
	_, body := picker.nextMessage(t)
	expectRequest(t, body, requestBody(completion, false))
	_, seen := picker.nextMessage(t)
	expectRequest(t, seen, requestTrailers())

	picker.write(t, answerFrame(t, id, pick("10.0.0.7:8100")), answerFrame(t, id, markedRequestBodyContinue("picker")),
		answerFrame(t, id, trailersContinue()))
	envoy.expect(pick("10.0.0.7:8100"))
	envoy.expect(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{
		RequestBody: streamed(completion, false),
	}})
	envoy.expect(trailersContinue())
}

// Headers, then trailers, with no body between them: the picker picks on the trailers and Envoy gets no body back.
func TestFullDuplexTrailersWithoutABodySendNoBodyBack(t *testing.T) {
	picker := startFakePicker(t)
	envoy := openStream(t, startRelay(t, picker.addr(), 1<<20))
	envoy.send(requestHeaders("/v1/models", false, fullDuplex), requestTrailers())
	id, _ := picker.nextMessage(t)
	_, seen := picker.nextMessage(t)
	expectRequest(t, seen, requestTrailers())

	picker.write(t, answerFrame(t, id, pick("10.0.0.7:8100")), answerFrame(t, id, trailersContinue()))
	envoy.expect(pick("10.0.0.7:8100"))
	envoy.expect(trailersContinue())
}

func TestTheRelayAnswersTheResponseAndItsEndHalfClosesThePickersStream(t *testing.T) {
	picker := startFakePicker(t)
	envoy := openStream(t, startRelay(t, picker.addr(), 1<<20))
	id := pickFullDuplex(t, picker, envoy)

	envoy.send(responseHeaders(false))
	seenID, seen := picker.nextMessage(t)
	if seenID != id {
		t.Fatalf("the response headers came on stream %d, want %d", seenID, id)
	}
	expectRequest(t, seen, responseHeaders(false))
	// The picker's own answer: the relay has already continued the headers, so this one goes nowhere.
	picker.write(t, answerFrame(t, id, markedResponseHeadersContinue("picker")))

	chunks := []string{"data: {\"text\":\"hi\"}\n\n", "data: {\"text\":\"!\"}\n\n", "data: [DONE]\n\n"}
	for i, chunk := range chunks {
		envoy.send(responseBody(chunk, i == len(chunks)-1))
	}
	// No body chunk reaches the picker; the body's end half-closes its stream (that releases the request's load).
	picker.expectEnd(t, id)
	picker.write(t, rawFrame(id, wireEnd, nil))
	if err := envoy.stream.CloseSend(); err != nil {
		t.Fatal(err)
	}
	answers, err := envoy.rest()
	if err != nil {
		t.Fatalf("Envoy's stream failed: %v", err)
	}
	expectAnswers(t, answers, responseHeadersContinue(),
		responseBodyEcho(chunks[0], false), responseBodyEcho(chunks[1], false), responseBodyEcho(chunks[2], true))
	picker.quiet(t)
}

func TestALongFullDuplexBodyGoesToThePickerInFlushSizedMessages(t *testing.T) {
	picker := startFakePicker(t)
	envoy := openStream(t, startRelay(t, picker.addr(), 4))
	envoy.send(requestHeaders("/v1/completions", false, fullDuplex))
	envoy.send(requestBody("ab", false), requestBody("cd", false), requestBody("ef", false), requestBody("g", true))
	id, _ := picker.nextMessage(t)
	for _, want := range []*extprocv3.ProcessingRequest{requestBody("abcd", false), requestBody("efg", true)} {
		_, got := picker.nextMessage(t)
		expectRequest(t, got, want)
	}
	picker.write(t, answerFrame(t, id, pick("10.0.0.7:8100")))
	envoy.expect(pick("10.0.0.7:8100"))
	envoy.expect(requestBodyEcho("abcdefg"))
}

// -- (c): STREAMED ----------------------------------------------------------------------------------------------

func TestStreamedBodiesAreForwardedChunkByChunkAndThePickersAnswersRelayedInOrder(t *testing.T) {
	picker := startFakePicker(t)
	envoy := openStream(t, startRelay(t, picker.addr(), 1<<20))
	config := modes(filterv3.ProcessingMode_STREAMED, filterv3.ProcessingMode_STREAMED)
	headers := requestHeaders("/v1/completions", false, config)
	envoy.send(headers)
	for i, chunk := range completionChunks {
		envoy.send(requestBody(chunk, i == len(completionChunks)-1))
	}
	id, seen := picker.nextMessage(t)
	expectRequest(t, seen, headers) // the gateway keeps the body: the picker is told so unchanged
	for i, chunk := range completionChunks {
		_, got := picker.nextMessage(t)
		expectRequest(t, got, requestBody(chunk, i == len(completionChunks)-1))
	}

	continues := []*extprocv3.ProcessingResponse{
		markedRequestBodyContinue("chunk-1"), markedRequestBodyContinue("chunk-2"), markedRequestBodyContinue("chunk-3"),
	}
	frames := [][]byte{answerFrame(t, id, pick("10.0.0.7:8100"))}
	for _, answer := range continues {
		frames = append(frames, answerFrame(t, id, answer))
	}
	picker.write(t, frames...)
	envoy.expect(pick("10.0.0.7:8100"))
	for _, answer := range continues {
		envoy.expect(answer)
	}

	// The response body in STREAMED mode is continued, not echoed; its end half-closes the picker's stream.
	envoy.send(responseHeaders(false), responseBody("data: x\n\n", false), responseBody("data: [DONE]\n\n", true))
	picker.nextMessage(t)
	picker.expectEnd(t, id)
	picker.write(t, rawFrame(id, wireEnd, nil))
	if err := envoy.stream.CloseSend(); err != nil {
		t.Fatal(err)
	}
	answers, err := envoy.rest()
	if err != nil {
		t.Fatalf("Envoy's stream failed: %v", err)
	}
	expectAnswers(t, answers, responseHeadersContinue(), responseBodyContinue(), responseBodyContinue())
}

// -- (d), (e): failures ------------------------------------------------------------------------------------------

func expectUnavailable(t *testing.T, err error, says string) {
	t.Helper()
	if status.Code(err) != codes.Unavailable || !strings.Contains(status.Convert(err).Message(), says) {
		t.Fatalf("Envoy's stream failed with %v, want UNAVAILABLE saying %q", err, says)
	}
}

func TestAnUnreachablePickerFailsEnvoysStreamAsUnavailable(t *testing.T) {
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := listener.Addr().String()
	_ = listener.Close() // nothing listens there now
	envoy := openStream(t, startRelay(t, addr, 1<<20))
	envoy.send(requestHeaders("/v1/completions", false, fullDuplex))
	expectUnavailable(t, envoy.failure(), "pdserve picker")
}

func TestALostLinkFailsItsStreamsAndTheNextStreamRedials(t *testing.T) {
	picker := startFakePicker(t)
	client := startRelay(t, picker.addr(), 1<<20)
	first := openStream(t, client)
	first.send(requestHeaders("/v1/completions", false, fullDuplex))
	picker.nextMessage(t)
	picker.closeConnections()
	expectUnavailable(t, first.failure(), "picker link lost")

	second := openStream(t, client)
	second.send(requestHeaders("/v1/completions", true, fullDuplex))
	id, _ := picker.nextMessage(t)
	picker.write(t, answerFrame(t, id, pick("10.0.0.8:8100")))
	second.expect(pick("10.0.0.8:8100"))
	if n := picker.connections(); n != 2 {
		t.Fatalf("the relay made %d link connections, want 2", n)
	}
}

func TestAnErrorFrameBeforeThePickFailsEnvoysStream(t *testing.T) {
	picker := startFakePicker(t)
	envoy := openStream(t, startRelay(t, picker.addr(), 1<<20))
	envoy.send(requestHeaders("/v1/completions", false, fullDuplex), requestBody(completion, true))
	id, _ := picker.nextMessage(t)
	picker.nextMessage(t)
	picker.write(t, rawFrame(id, wireError, []byte("ValueError: no decode engine")))
	expectUnavailable(t, envoy.failure(), "no decode engine")
}

// syncBuffer collects the relay's log (it logs from the stream's goroutines).
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func TestAnErrorFrameAfterThePickLetsTheResponseComplete(t *testing.T) {
	logs, original := &syncBuffer{}, log.Writer()
	log.SetOutput(logs)
	t.Cleanup(func() { log.SetOutput(original) })
	picker := startFakePicker(t)
	envoy := openStream(t, startRelay(t, picker.addr(), 1<<20))
	id := pickFullDuplex(t, picker, envoy)
	picker.write(t, rawFrame(id, wireError, []byte("RuntimeError: late")))
	// The relay has taken the error in when it logs it; the response goes on after that.
	deadline := time.Now().Add(waitFor)
	for !strings.Contains(logs.String(), "failed after the pick") {
		if time.Now().After(deadline) {
			t.Fatalf("the relay did not log the picker's late failure; its log: %q", logs.String())
		}
		time.Sleep(5 * time.Millisecond)
	}
	envoy.send(responseHeaders(false), responseBody("data: x\n\n", false), responseBody("data: [DONE]\n\n", true))
	if err := envoy.stream.CloseSend(); err != nil {
		t.Fatal(err)
	}
	answers, err := envoy.rest()
	if err != nil {
		t.Fatalf("Envoy's stream failed after the pick: %v", err)
	}
	expectAnswers(t, answers, responseHeadersContinue(),
		responseBodyEcho("data: x\n\n", false), responseBodyEcho("data: [DONE]\n\n", true))
}

// -- (f), (g): cancellation, several streams ---------------------------------------------------------------------

func TestEnvoyCancellingAStreamEndsThePickersStreamOnce(t *testing.T) {
	picker := startFakePicker(t)
	envoy := openStream(t, startRelay(t, picker.addr(), 1<<20))
	envoy.send(requestHeaders("/v1/completions", false, fullDuplex), requestBody(completion, true))
	id, _ := picker.nextMessage(t)
	picker.nextMessage(t)
	envoy.cancel() // the client left before the pick
	picker.expectEnd(t, id)
	picker.quiet(t)
}

func TestConcurrentStreamsAreDemultiplexed(t *testing.T) {
	picker := startFakePicker(t)
	client := startRelay(t, picker.addr(), 1<<20)
	paths := []string{"/v1/completions?a", "/v1/completions?b"}
	bodies := []string{`{"prompt":"aaa"}`, `{"prompt":"bbb"}`}
	streams := []*envoyStream{openStream(t, client), openStream(t, client)}
	for i, envoy := range streams {
		envoy.send(requestHeaders(paths[i], false, fullDuplex))
	}
	for i, envoy := range streams {
		envoy.send(requestBody(bodies[i], true))
	}

	// Four messages in some order: tell the streams apart by their paths, then check each body's stream.
	byPath := map[string]uint32{}
	bodyOf := map[uint32]string{}
	for range 4 {
		id, message := picker.nextMessage(t)
		if headers := message.GetRequestHeaders(); headers != nil {
			byPath[string(headers.GetHeaders().GetHeaders()[1].GetRawValue())] = id
		} else {
			bodyOf[id] = string(message.GetRequestBody().GetBody())
		}
	}
	ids := []uint32{byPath[paths[0]], byPath[paths[1]]}
	if ids[0] == 0 || ids[1] == 0 || ids[0] == ids[1] {
		t.Fatalf("stream ids by path %v", byPath)
	}
	for i, id := range ids {
		if bodyOf[id] != bodies[i] {
			t.Fatalf("stream %d (%s) carried the body %q, want %q", id, paths[i], bodyOf[id], bodies[i])
		}
	}

	// The picker answers the second stream first.
	picker.write(t, answerFrame(t, ids[1], pick("10.0.0.2:8100")), answerFrame(t, ids[0], pick("10.0.0.1:8100")))
	streams[0].expect(pick("10.0.0.1:8100"))
	streams[0].expect(requestBodyEcho(bodies[0]))
	streams[1].expect(pick("10.0.0.2:8100"))
	streams[1].expect(requestBodyEcho(bodies[1]))

	// Envoy half-closes the second stream: only its stream ends at the picker; its END ends Envoy's stream only.
	if err := streams[1].stream.CloseSend(); err != nil {
		t.Fatal(err)
	}
	picker.expectEnd(t, ids[1])
	picker.write(t, rawFrame(ids[1], wireEnd, nil))
	if answers, err := streams[1].rest(); err != nil || len(answers) != 0 {
		t.Fatalf("the second stream ended with %v after %d more answers", err, len(answers))
	}
	streams[0].send(responseHeaders(true))
	streams[0].expect(responseHeadersContinue())
	picker.nextMessage(t)
	picker.expectEnd(t, ids[0])
}

// -- (h): health -------------------------------------------------------------------------------------------------

func servingStatus(t *testing.T, server *health.Server, service string) healthpb.HealthCheckResponse_ServingStatus {
	t.Helper()
	answer, err := server.Check(context.Background(), &healthpb.HealthCheckRequest{Service: service})
	if err != nil {
		t.Fatalf("the relay's health for %q: %v", service, err)
	}
	return answer.GetStatus()
}

func waitStatus(t *testing.T, server *health.Server, service string, want healthpb.HealthCheckResponse_ServingStatus) {
	t.Helper()
	deadline := time.Now().Add(waitFor)
	for servingStatus(t, server, service) != want {
		if time.Now().After(deadline) {
			t.Fatalf("the relay's health for %q stayed %v, want %v", service, servingStatus(t, server, service), want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestHealthIsLiveAtOnceAndReadyOnlyWhileThePickerSaysSo(t *testing.T) {
	const (
		serving    = healthpb.HealthCheckResponse_SERVING
		notServing = healthpb.HealthCheckResponse_NOT_SERVING
		extProc    = "envoy.service.ext_proc.v3.ExternalProcessor"
	)
	relayHealth := newHealth()
	if got := servingStatus(t, relayHealth, "liveness"); got != serving {
		t.Fatalf("liveness is %v before the picker is asked, want SERVING", got)
	}
	for _, service := range []string{"readiness", extProc, ""} {
		if got := servingStatus(t, relayHealth, service); got != notServing {
			t.Fatalf("%q is %v before the picker is asked, want NOT_SERVING", service, got)
		}
	}

	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	pickerHealth := health.NewServer()
	pickerHealth.SetServingStatus("liveness", notServing) // the relay's own liveness is never the picker's
	pickerHealth.SetServingStatus("readiness", notServing)
	pickerHealth.SetServingStatus(extProc, notServing)
	pickerHealth.SetServingStatus("", notServing)
	server := grpc.NewServer()
	healthpb.RegisterHealthServer(server, pickerHealth)
	go func() { _ = server.Serve(listener) }()
	t.Cleanup(server.Stop)
	conn, err := grpc.NewClient(listener.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { mirrorHealth(ctx, conn, relayHealth, 20*time.Millisecond); close(done) }()
	t.Cleanup(func() { cancel(); <-done })

	time.Sleep(quietFor) // several polls of a picker that is not ready
	for _, service := range []string{"readiness", extProc, ""} {
		if got := servingStatus(t, relayHealth, service); got != notServing {
			t.Fatalf("%q is %v while the picker says NOT_SERVING", service, got)
		}
	}
	if got := servingStatus(t, relayHealth, "liveness"); got != serving {
		t.Fatalf("liveness is %v while the picker runs, want SERVING", got)
	}

	pickerHealth.SetServingStatus("readiness", serving)
	waitStatus(t, relayHealth, "readiness", serving)
	if got := servingStatus(t, relayHealth, extProc); got != notServing {
		t.Fatalf("%q is %v: it must mirror the picker's own answer for it (NOT_SERVING)", extProc, got)
	}
	pickerHealth.SetServingStatus(extProc, serving)
	waitStatus(t, relayHealth, extProc, serving)

	// The picker goes away: the relay is not ready (a gateway sends it nothing), still alive.
	server.Stop()
	waitStatus(t, relayHealth, "readiness", notServing)
	waitStatus(t, relayHealth, extProc, notServing)
	if got := servingStatus(t, relayHealth, "liveness"); got != serving {
		t.Fatalf("liveness is %v without the picker, want SERVING", got)
	}
}
