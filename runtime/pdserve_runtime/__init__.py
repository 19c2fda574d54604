"""The pdserve data plane: the PD router (`router/`); the autoscaler's runtime pieces land here if they run
outside the operator."""
