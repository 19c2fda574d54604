"""Defaults the operator applies to absent fields, in one place.

They are deliberately not in the CRD schema (the API server would write them into stored objects and freeze
them); the renderer and validation read them from here, and the README documents them.
"""

from __future__ import annotations

ENGINE_PORT = 8000
SIDE_CHANNEL_PORT = 5600
BLOCK_SIZE = 16
KV_CACHE_DTYPE = "auto"
KV_CONNECTOR = "nixl"
KV_BUFFER_DEVICE = "cuda"
KV_LEASE_SECONDS = 30
KV_LOAD_FAILURE_POLICY = "fail"
ATTENTION = "standard"
SHM_SIZE = "16Gi"

GPU_RESOURCE = "nvidia.com/gpu"
RDMA_RESOURCE = "rdma/ib"
RDMA_COUNT = 1
RDMA_POLICY = "required"
RDMA_NODE_LABEL = "pdserve.io/rdma"
COLOCATION = "preferred"
SPREAD_KEY = "kubernetes.io/hostname"
MAX_SKEW = 1
POOL_MAX_UNAVAILABLE = 1

ROUTER_IMAGE = "ghcr.io/pdserve/pdserve:0.1.0"
ROUTER_REPLICAS = 2
ROUTER_PORT = 8080
ROUTER_SERVICE_TYPE = "ClusterIP"
DISAGGREGATION_THRESHOLD = 256
PREFIX_AWARE = True
FALLBACK_TO_DECODE = True

AUTOSCALING_MIN = 1
AUTOSCALING_MAX = 8
SLO_PERCENTILE = 90

# Engine containers get a long grace period: vLLM drains running requests on SIGTERM, and a prefill engine
# should keep serving KV pulls for blocks it already handed out (the lease) before it exits.
ENGINE_TERMINATION_GRACE_SECONDS = 60
ROUTER_TERMINATION_GRACE_SECONDS = 30
