"""The pdserve data plane: the PD router, the engine simulator and the autoscaler pieces."""
