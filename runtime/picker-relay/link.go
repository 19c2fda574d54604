package main

// The client side of the picker link (runtime/pdserve_runtime/gateway/link.py): one loopback TCP connection to
// the picker carrying every relayed stream, ext_proc messages in frames of
//
//	stream id (uint32, big endian) | kind (uint8) | payload length (uint32) | payload
//
// MESSAGE frames carry a ProcessingRequest (to the picker) or a ProcessingResponse (back); END half-closes a
// stream (the picker releases its load and answers END once every answer of the stream is written); ERROR (from
// the picker) fails the stream. Python's gRPC costs the picker about a millisecond of wake-ups per message on the
// time to first token; this link costs it one socket read and one write.

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

const (
	frameMessage byte = 1
	frameEnd     byte = 2
	frameError   byte = 3
	headerSize        = 9
)

// pickerStream is one request's exchange with the picker (what the relay needs of a gRPC client stream).
type pickerStream interface {
	Send(*extprocv3.ProcessingRequest) error
	CloseSend() error
	Recv() (*extprocv3.ProcessingResponse, error)
}

// Link dials the picker's link on first use and again after the connection is lost.
type Link struct {
	addr        string
	maxFrame    int
	dialTimeout time.Duration

	mu     sync.Mutex
	conn   *linkConn
	nextID uint32
}

// NewLink returns a link to the picker at addr; frames above maxFrame bytes end the connection.
func NewLink(addr string, maxFrame int) *Link {
	return &Link{addr: addr, maxFrame: maxFrame, dialTimeout: time.Second}
}

// Open starts a stream; it ends (END) when ctx does.
func (l *Link) Open(ctx context.Context) (pickerStream, error) {
	conn, id, err := l.connection()
	if err != nil {
		return nil, err
	}
	s := &linkStream{conn: conn, id: id, ctx: ctx, notify: make(chan struct{}, 1)}
	conn.mu.Lock()
	if conn.err != nil {
		conn.mu.Unlock()
		return nil, conn.err
	}
	conn.streams[id] = s
	conn.mu.Unlock()
	return s, nil
}

func (l *Link) connection() (*linkConn, uint32, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.conn == nil || l.conn.failed() {
		c, err := net.DialTimeout("tcp", l.addr, l.dialTimeout)
		if err != nil {
			return nil, 0, fmt.Errorf("picker link %s: %w", l.addr, err)
		}
		l.conn = &linkConn{c: c, maxFrame: l.maxFrame, streams: map[uint32]*linkStream{}}
		go l.conn.read()
	}
	l.nextID++
	return l.conn, l.nextID, nil
}

type linkConn struct {
	c        net.Conn
	maxFrame int
	writeMu  sync.Mutex

	mu      sync.Mutex
	streams map[uint32]*linkStream
	err     error // set once the connection is lost
}

func (c *linkConn) failed() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err != nil
}

func (c *linkConn) write(id uint32, kind byte, payload []byte) error {
	buf := make([]byte, headerSize+len(payload))
	binary.BigEndian.PutUint32(buf[0:4], id)
	buf[4] = kind
	binary.BigEndian.PutUint32(buf[5:9], uint32(len(payload)))
	copy(buf[headerSize:], payload)
	c.writeMu.Lock()
	defer c.writeMu.Unlock()
	_, err := c.c.Write(buf)
	if err != nil {
		c.fail(err)
	}
	return err
}

// read delivers frames to their streams until the connection fails.
func (c *linkConn) read() {
	header := make([]byte, headerSize)
	for {
		if _, err := io.ReadFull(c.c, header); err != nil {
			c.fail(err)
			return
		}
		id, kind, length := binary.BigEndian.Uint32(header[0:4]), header[4], binary.BigEndian.Uint32(header[5:9])
		if int(length) > c.maxFrame {
			c.fail(fmt.Errorf("a frame of %d bytes", length))
			return
		}
		payload := make([]byte, length)
		if _, err := io.ReadFull(c.c, payload); err != nil {
			c.fail(err)
			return
		}
		c.mu.Lock()
		s := c.streams[id]
		if kind != frameMessage {
			delete(c.streams, id)
		}
		c.mu.Unlock()
		if s == nil {
			continue // a stream that already ended (its context was cancelled)
		}
		switch kind {
		case frameMessage:
			answer := &extprocv3.ProcessingResponse{}
			if err := proto.Unmarshal(payload, answer); err != nil {
				s.finish(fmt.Errorf("picker answer: %w", err))
				continue
			}
			s.deliver(answer)
		case frameEnd:
			s.finish(io.EOF)
		default:
			s.finish(status.Error(codes.Unavailable, string(payload)))
		}
	}
}

func (c *linkConn) fail(err error) {
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		return
	}
	c.err = fmt.Errorf("picker link lost: %w", err)
	streams := c.streams
	c.streams = map[uint32]*linkStream{}
	c.mu.Unlock()
	_ = c.c.Close()
	for _, s := range streams {
		s.finish(c.err)
	}
}

type linkStream struct {
	conn   *linkConn
	id     uint32
	ctx    context.Context
	notify chan struct{}

	mu       sync.Mutex
	queue    []*extprocv3.ProcessingResponse
	finished error // io.EOF when the picker ended the stream, else why it failed
	ended    bool  // END sent
}

func (s *linkStream) Send(message *extprocv3.ProcessingRequest) error {
	payload, err := proto.Marshal(message)
	if err != nil {
		return err
	}
	return s.conn.write(s.id, frameMessage, payload)
}

func (s *linkStream) CloseSend() error {
	s.mu.Lock()
	if s.ended {
		s.mu.Unlock()
		return nil
	}
	s.ended = true
	s.mu.Unlock()
	return s.conn.write(s.id, frameEnd, nil)
}

func (s *linkStream) Recv() (*extprocv3.ProcessingResponse, error) {
	for {
		s.mu.Lock()
		if len(s.queue) > 0 {
			answer := s.queue[0]
			s.queue[0] = nil
			s.queue = s.queue[1:]
			s.mu.Unlock()
			return answer, nil
		}
		if s.finished != nil {
			err := s.finished
			s.mu.Unlock()
			return nil, err
		}
		s.mu.Unlock()
		select {
		case <-s.notify:
		case <-s.ctx.Done():
			_ = s.CloseSend() // release the picker's side
			return nil, status.FromContextError(s.ctx.Err()).Err()
		}
	}
}

func (s *linkStream) deliver(answer *extprocv3.ProcessingResponse) {
	s.mu.Lock()
	s.queue = append(s.queue, answer)
	s.mu.Unlock()
	s.wake()
}

func (s *linkStream) finish(err error) {
	s.mu.Lock()
	if s.finished == nil {
		s.finished = err
	}
	s.mu.Unlock()
	s.wake()
}

func (s *linkStream) wake() {
	select {
	case s.notify <- struct{}{}:
	default:
	}
}
