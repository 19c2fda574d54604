"""The Gateway API Inference Extension path: pdserve's endpoint picker (Envoy ext_proc) and the PD sidecar."""
