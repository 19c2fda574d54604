"""pdserve: a Kubernetes operator, PD router and SLO autoscaler for prefill/decode disaggregated vLLM."""

__version__ = "0.1.0"
