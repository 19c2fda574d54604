"""Discrete-event replay of a PD service under an autoscaler: the autoscaler benchmark's engine room.

A trace of requests (the Azure LLM traces of the Splitwise paper, or a synthetic step/ramp/sine+burst shape)
is replayed against pools of simulated engines in virtual time, so an hour of traffic on a hundred replicas
takes seconds, and the same replay can be run under several scaling policies.

- `trace`: load, slice, compress and rate-scale traces; the synthetic shape.
- `histogram`: fixed-bucket histograms and Prometheus' `histogram_quantile`, so signals are computed the way
  Prometheus would compute them from the router's and engines' buckets.
- `engines`: one prefill and one decode engine, stepping with the simulator's own cost model
  (`pdserve_sim.presets.TimingParams.step_seconds`) and the scheduling rules of `pdserve_sim.engine`
  (chunked prefill under a token budget, max_num_seqs, KV blocks, a PD request's KV pull outside the batch and
  its one-token prefill step on joining), at request granularity: a step costs O(requests that join or leave).
- `path`: what a request's path costs beyond the engines' steps (router, engine requests, KV socket, client),
  per hop; none for the H200 scenarios, measured on loopback for the closed loop's replay.
- `cluster`: the service: router (PD for long prompts, decode-only for short ones), pools whose replicas start,
  serve, drain and go, the control ticks, GPU-seconds and per-request outcomes.
- `observe`: the signals a tick sees, in the autoscaler's own `ServiceSignals` types (windowed rates and
  quantiles over live pods, pod ages for the warm-up filter), plus the utilisation figures an HPA would read.
- `scalers`: the policies compared: static-peak, hpa-style, llm-d-slo and pdserve (the product's `Autoscaler`).
- `dynamo`: NVIDIA Dynamo's SLA planner (throughput path with a load predictor as lower bound, load path with
  its all-engines-over scale-up and consolidation-checked scale-down), rebuilt from its source.
"""
