package main

// The relay's gRPC health: what Envoy, a gateway and the kubelet ask on the picker's port. `liveness` is the
// relay's own (SERVING while it runs); every other service mirrors the picker's answer for it, polled every
// interval, and is NOT_SERVING while the picker cannot be asked (a gateway then sends nothing to this pod).

import (
	"context"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

const livenessService = "liveness"

// mirroredServices are the picker's health services a gateway or a probe may ask for.
var mirroredServices = []string{"readiness", "envoy.service.ext_proc.v3.ExternalProcessor", ""}

// newHealth returns the relay's health server: live, and not ready until the picker says it is.
func newHealth() *health.Server {
	server := health.NewServer()
	server.SetServingStatus(livenessService, healthpb.HealthCheckResponse_SERVING)
	for _, service := range mirroredServices {
		server.SetServingStatus(service, healthpb.HealthCheckResponse_NOT_SERVING)
	}
	return server
}

// mirrorHealth copies the picker's health into server every interval until ctx ends.
func mirrorHealth(ctx context.Context, picker *grpc.ClientConn, server *health.Server, interval time.Duration) {
	client := healthpb.NewHealthClient(picker)
	ticker := time.NewTicker(interval)
	defer ticker.Stop()
	for {
		for _, service := range mirroredServices {
			server.SetServingStatus(service, pickerStatus(ctx, client, service, interval))
		}
		select {
		case <-ctx.Done():
			return
		case <-ticker.C:
		}
	}
}

func pickerStatus(
	ctx context.Context, client healthpb.HealthClient, service string, timeout time.Duration,
) healthpb.HealthCheckResponse_ServingStatus {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	answer, err := client.Check(ctx, &healthpb.HealthCheckRequest{Service: service})
	if err != nil || answer.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		return healthpb.HealthCheckResponse_NOT_SERVING
	}
	return healthpb.HealthCheckResponse_SERVING
}
