package main

// The relay: Envoy's ext_proc streams on one side, pdserve's Python endpoint picker on the other.
//
// Behind a Gateway API Inference Extension gateway every response body chunk is an ext_proc round trip
// (FULL_DUPLEX_STREAMED: the processor must send each chunk back). In Python's gRPC that costs about 100 us of CPU
// per message, some 65 messages a request at 64 streamed tokens: more than pdserve's router spends on the whole
// request. The relay answers those messages itself and hands the picker only what it decides or learns from:
//
//	request headers            -> forwarded (the picker answers with the pick once the body is complete)
//	request body (full duplex) -> kept by the relay and forwarded in one message (or one per flushBytes), with
//	                              the picker told the body mode is BUFFERED: the relay, like a gateway that
//	                              buffers, owns the body and sends it back to Envoy itself right after the pick,
//	                              so the picker never serialises the body a second time (its "continue" answers
//	                              to those messages are dropped)
//	request body (other modes) -> forwarded chunk by chunk (the gateway expects one answer per chunk)
//	request trailers           -> forwarded (their answer must follow the pick's); in full duplex a body that
//	                              ends with trailers has no chunk with end_of_stream, so the trailers complete
//	                              it: the rest of the body goes to the picker first, and the body sent back to
//	                              Envoy leaves the stream open for the trailers' answer
//	response headers           -> forwarded, and continued by the relay at once: the picker reads the served
//	                              endpoint and the status from them, off the time to first token
//	response body, trailers    -> answered by the relay (echoed in full duplex, continued otherwise); the end of
//	                              the response half-closes the picker's stream, which releases the request's load
//
// Every answer the picker sends is relayed in order, except its answers to response headers (the relay has
// already continued them). The scheduling stays the picker's: the relay never decides anything. When the picker
// cannot be reached or its stream fails, Envoy's stream fails with UNAVAILABLE and the gateway applies the pool's
// failure mode, as it would with the picker itself down.

import (
	"context"
	"errors"
	"io"
	"log"
	"sync"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// Relay is the ExternalProcessor service Envoy talks to.
type Relay struct {
	extprocv3.UnimplementedExternalProcessorServer
	open       func(context.Context) (pickerStream, error)
	flushBytes int
}

// NewRelay relays to the picker's streams that open starts; full-duplex request bodies are forwarded in messages
// of at most about flushBytes.
func NewRelay(open func(context.Context) (pickerStream, error), flushBytes int) *Relay {
	return &Relay{open: open, flushBytes: flushBytes}
}

var errEnvoyGone = errors.New("envoy's stream ended while the picker answered")

// Process relays one request's ext_proc stream.
func (r *Relay) Process(envoy extprocv3.ExternalProcessor_ProcessServer) error {
	ctx, cancel := context.WithCancel(envoy.Context())
	defer cancel()
	upstream, err := r.open(ctx)
	if err != nil {
		return status.Errorf(codes.Unavailable, "pdserve picker: %v", err)
	}
	s := &stream{relay: r, envoy: envoy, upstream: upstream, requestDuplex: true, responseDuplex: true}
	answers := make(chan error, 1)
	go func() { answers <- s.relayAnswers() }()
	requests := make(chan error, 1)
	go func() { requests <- s.relayRequests() }()
	select {
	case err := <-answers:
		if err != nil && !s.wasPicked() {
			return pickerFailure(err)
		}
		// The picker ended its stream (it does so only after the relay half-closed it), or failed after the pick:
		// the response needs nothing more from it (the relay answers for it), so it goes on to its end.
		if err != nil && !errors.Is(err, errEnvoyGone) && status.Code(err) != codes.Canceled {
			log.Printf("pdserve-picker-relay: the picker's stream failed after the pick: %v", err)
		}
		return <-requests
	case err := <-requests:
		if err != nil {
			return err // Envoy's side failed (the client left): the deferred cancel ends the picker's stream
		}
		if err := <-answers; err != nil && !s.wasPicked() {
			return pickerFailure(err)
		}
		return nil // a picker failure after the pick changes nothing for a response that is over
	}
}

func pickerFailure(err error) error {
	if errors.Is(err, errEnvoyGone) {
		return err
	}
	if s, ok := status.FromError(err); ok && s.Code() != codes.Unknown {
		return status.Errorf(codes.Unavailable, "pdserve picker: %s", s.Message())
	}
	return status.Errorf(codes.Unavailable, "pdserve picker: %v", err)
}

// stream is the state of one relayed request.
type stream struct {
	relay    *Relay
	envoy    extprocv3.ExternalProcessor_ProcessServer
	upstream pickerStream
	sendMu   sync.Mutex // Envoy's stream has two writers: the request pump (echoes) and the answer relay

	requestDuplex  bool
	responseDuplex bool
	upstreamClosed bool // half-closed, or broken: nothing more goes to the picker

	// Guarded by sendMu (the answer relay reads them): a full-duplex request body, kept until the pick is
	// relayed, how much of it went to the picker, and whether its end has arrived.
	body         []byte
	forwarded    int
	bodyComplete bool
	bodyEchoed   bool
	trailers     bool // the request's trailers ended its body (end_of_stream comes with them, not the body)
	picked       bool // the picker's answer to the request headers went to Envoy
}

func (s *stream) wasPicked() bool {
	s.sendMu.Lock()
	defer s.sendMu.Unlock()
	return s.picked
}

func (s *stream) toEnvoy(message *extprocv3.ProcessingResponse) error {
	s.sendMu.Lock()
	defer s.sendMu.Unlock()
	return s.envoy.Send(message)
}

func (s *stream) toPicker(message *extprocv3.ProcessingRequest) {
	if s.upstreamClosed {
		return
	}
	if err := s.upstream.Send(message); err != nil {
		// The stream broke; its error comes out of Recv in relayAnswers, which fails Envoy's stream.
		s.upstreamClosed = true
	}
}

func (s *stream) closePicker() {
	if !s.upstreamClosed {
		s.upstreamClosed = true
		_ = s.upstream.CloseSend()
	}
}

// relayAnswers sends the picker's answers on to Envoy until the picker ends its stream.
func (s *stream) relayAnswers() error {
	for {
		answer, err := s.upstream.Recv()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
		if err := s.relayAnswer(answer); err != nil {
			return errEnvoyGone
		}
	}
}

func (s *stream) relayAnswer(answer *extprocv3.ProcessingResponse) error {
	s.sendMu.Lock()
	defer s.sendMu.Unlock()
	switch answer.Response.(type) {
	case *extprocv3.ProcessingResponse_ResponseHeaders:
		return nil // already continued by the relay
	case *extprocv3.ProcessingResponse_RequestBody:
		if s.requestDuplex {
			return nil // the relay sends the body back itself (the picker was told BUFFERED)
		}
	case *extprocv3.ProcessingResponse_RequestHeaders:
		if err := s.envoy.Send(answer); err != nil {
			return err
		}
		s.picked = true
		if s.requestDuplex && s.bodyComplete && !s.bodyEchoed {
			s.bodyEchoed = true
			body := s.body
			s.body = nil
			return s.envoy.Send(echoRequestBody(body, !s.trailers))
		}
		return nil
	}
	return s.envoy.Send(answer)
}

// relayRequests reads Envoy's messages until Envoy half-closes (nil) or its stream fails (the error).
func (s *stream) relayRequests() error {
	defer s.closePicker()
	for {
		message, err := s.envoy.Recv()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
		if config := message.GetProtocolConfig(); config != nil {
			s.setModes(config)
			message = withPickerModes(message)
		}
		if err := s.handle(message); err != nil {
			return err
		}
	}
}

func (s *stream) setModes(config *extprocv3.ProtocolConfiguration) {
	s.sendMu.Lock()
	defer s.sendMu.Unlock()
	s.requestDuplex = config.GetRequestBodyMode() == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
	s.responseDuplex = config.GetResponseBodyMode() == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
}

// withPickerModes is the message as the picker sees it: a full-duplex request body arrives buffered (the relay
// keeps it and answers for it).
func withPickerModes(message *extprocv3.ProcessingRequest) *extprocv3.ProcessingRequest {
	config := message.GetProtocolConfig()
	if config.GetRequestBodyMode() != filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
		return message
	}
	seen := proto.Clone(config).(*extprocv3.ProtocolConfiguration)
	seen.RequestBodyMode = filterv3.ProcessingMode_BUFFERED
	out := withContext(message, seen)
	out.Request = message.Request
	return out
}

// withContext is a new message with message's metadata and attributes and the given protocol configuration (the
// caller sets its request).
func withContext(message *extprocv3.ProcessingRequest, config *extprocv3.ProtocolConfiguration) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{
		MetadataContext:   message.GetMetadataContext(),
		Attributes:        message.GetAttributes(),
		ObservabilityMode: message.GetObservabilityMode(),
		ProtocolConfig:    config,
	}
}

func (s *stream) handle(message *extprocv3.ProcessingRequest) error {
	switch request := message.Request.(type) {
	case *extprocv3.ProcessingRequest_RequestBody:
		if s.requestDuplex {
			s.requestBody(message, request.RequestBody)
		} else {
			s.toPicker(message)
		}
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		s.toPicker(message)
		if err := s.toEnvoy(continueResponseHeaders()); err != nil {
			return err
		}
		if request.ResponseHeaders.GetEndOfStream() {
			s.closePicker()
		}
	case *extprocv3.ProcessingRequest_ResponseBody:
		body := request.ResponseBody
		answer := continueResponseBody()
		if s.responseDuplex {
			answer = echoResponseBody(body.GetBody(), body.GetEndOfStream())
		}
		if err := s.toEnvoy(answer); err != nil {
			return err
		}
		if body.GetEndOfStream() {
			s.closePicker()
		}
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		if err := s.toEnvoy(continueResponseTrailers()); err != nil {
			return err
		}
		s.closePicker()
	case *extprocv3.ProcessingRequest_RequestTrailers:
		if s.requestDuplex {
			s.trailersEndBody(message)
		}
		s.toPicker(message)
	default: // request headers
		s.toPicker(message)
	}
	return nil
}

// requestBody keeps and coalesces a full-duplex request body: the picker needs the whole body before it picks,
// and each message it reads costs it far more than the bytes do.
func (s *stream) requestBody(message *extprocv3.ProcessingRequest, body *extprocv3.HttpBody) {
	end := body.GetEndOfStream()
	if unsent, due := s.keep(body.GetBody(), end); due {
		s.bodyToPicker(message, unsent, end)
	}
}

// bodyToPicker sends the picker part of a kept body, with message's metadata and attributes.
func (s *stream) bodyToPicker(message *extprocv3.ProcessingRequest, body []byte, end bool) {
	out := withContext(message, message.GetProtocolConfig())
	out.Request = &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: body, EndOfStream: end}}
	s.toPicker(out)
}

// trailersEndBody completes a full-duplex body that trailers end: the picker gets what it has not had yet, with
// end_of_stream unset as a buffering gateway sends a body before its trailers, and decides on the trailers.
func (s *stream) trailersEndBody(message *extprocv3.ProcessingRequest) {
	s.sendMu.Lock()
	if s.bodyComplete {
		s.sendMu.Unlock()
		return
	}
	s.bodyComplete, s.trailers = true, true
	// Headers, then trailers, no body: there is nothing to send back (Envoy sent no body to answer).
	s.bodyEchoed = len(s.body) == 0
	unsent := s.body[s.forwarded:]
	s.forwarded = len(s.body)
	s.sendMu.Unlock()
	if len(unsent) > 0 {
		s.bodyToPicker(message, unsent, false)
	}
}

// keep appends a chunk to the kept body and returns the part the picker has not had yet when it is time to send
// it (the body's end, or flushBytes of it), and whether it is time.
func (s *stream) keep(chunk []byte, end bool) ([]byte, bool) {
	s.sendMu.Lock()
	defer s.sendMu.Unlock()
	s.body = append(s.body, chunk...)
	s.bodyComplete = end
	if !end && len(s.body)-s.forwarded < s.relay.flushBytes {
		return nil, false
	}
	unsent := s.body[s.forwarded:]
	s.forwarded = len(s.body)
	return unsent, true
}

func continueResponseHeaders() *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{
		ResponseHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{}},
	}}
}

func continueResponseBody() *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{
		ResponseBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{}},
	}}
}

func continueResponseTrailers() *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{
		ResponseTrailers: &extprocv3.TrailersResponse{},
	}}
}

// streamedBody sends a body back unchanged: in full-duplex streaming the processor owns the body.
func streamedBody(chunk []byte, end bool) *extprocv3.BodyResponse {
	return &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{
		BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
			StreamedResponse: &extprocv3.StreamedBodyResponse{Body: chunk, EndOfStream: end},
		}},
	}}
}

func echoResponseBody(chunk []byte, end bool) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{
		ResponseBody: streamedBody(chunk, end),
	}}
}

func echoRequestBody(body []byte, end bool) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{
		RequestBody: streamedBody(body, end),
	}}
}
