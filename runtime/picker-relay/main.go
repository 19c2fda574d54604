// Command pdserve-picker-relay serves Envoy's ext_proc protocol in front of pdserve's endpoint picker.
//
// It runs beside the picker (`pdserve picker --grpc-port 9003 --link-port 9004`) in the picker's pod and listens
// where a gateway's InferencePool sends ext_proc streams; relay.go says what it answers itself and what it hands
// the picker, link.go how.
package main

import (
	"context"
	"flag"
	"log"
	"net"
	"os"
	"os/signal"
	"syscall"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

func main() {
	listen := flag.String("listen", ":9002", "address the gateway's ext_proc streams and health checks reach")
	link := flag.String("picker-link", ":9004",
		"the pdserve picker's link (`pdserve picker --link-port`); no host: the pod's own address (below)")
	picker := flag.String("picker-grpc", ":9003", "the pdserve picker's gRPC address (its health is read there)")
	maxMessage := flag.Int("max-message-bytes", 8*1024*1024+64*1024,
		"largest gRPC message either way (a whole request body comes back from the picker in one)")
	flush := flag.Int("flush-bytes", 1024*1024, "a full-duplex request body goes to the picker in messages of this size")
	interval := flag.Duration("health-interval", 500*time.Millisecond, "how often the picker's health is read")
	grace := flag.Duration("grace", 10*time.Second, "how long streams in flight may finish on SIGTERM")
	flag.Parse()
	if err := run(*listen, podLocal(*link), podLocal(*picker), *maxMessage, *flush, *interval, *grace); err != nil {
		log.Fatalf("pdserve-picker-relay: %v", err)
	}
}

// podLocal gives an address without a host the pod's own: $PDSERVE_BIND_HOST where pods share one network
// namespace and each listens on its own address (pdserve's process node; the picker binds there too), else
// loopback.
func podLocal(address string) string {
	host, port, err := net.SplitHostPort(address)
	if err != nil || host != "" {
		return address
	}
	host = os.Getenv("PDSERVE_BIND_HOST")
	if host == "" {
		host = "127.0.0.1"
	}
	return net.JoinHostPort(host, port)
}

func run(listen, link, picker string, maxMessage, flush int, interval, grace time.Duration) error {
	conn, err := grpc.NewClient(picker, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	listener, err := net.Listen("tcp", listen)
	if err != nil {
		return err
	}
	server := grpc.NewServer(grpc.MaxRecvMsgSize(maxMessage), grpc.MaxSendMsgSize(maxMessage))
	extprocv3.RegisterExternalProcessorServer(server, NewRelay(NewLink(link, maxMessage).Open, flush))
	healthServer := newHealth()
	healthpb.RegisterHealthServer(server, healthServer)
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	go mirrorHealth(ctx, conn, healthServer, interval)
	go func() {
		<-ctx.Done()
		healthServer.Shutdown() // every service NOT_SERVING: gateways stop sending new streams here
		timer := time.AfterFunc(grace, server.Stop)
		defer timer.Stop()
		server.GracefulStop()
	}()
	log.Printf("pdserve-picker-relay: listening on %s, picker link %s, picker health %s", listener.Addr(), link, picker)
	return server.Serve(listener)
}
