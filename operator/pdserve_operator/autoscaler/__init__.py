"""pdserve's SLO autoscaler: TTFT drives the prefill pool, inter-token latency drives the decode pool.

Where it runs (decision): inside the operator process, one control loop per PDService that has autoscaling
enabled, only on the elected leader. The operator already holds what the loop needs and a separate Deployment
would duplicate it: the informer cache of the service's pods (the live-pod filter, pod ages for the warm-up,
Pending pods), leader election (exactly one writer of each pool's /scale), the event recorder, the status
writer and the metrics registry. One process also means one failure domain and one RBAC role. The cost is
isolation: a slow Prometheus must never stall reconciles, so the loop is its own task, the Prometheus client
(synchronous) runs in a worker thread with a timeout, and a failed read holds the pools (fail-static).

The loop, collector -> model -> policy -> actuator (Kthena, Dynamo's planner and HPA have the same shape):

- `signals`: typed observations of one service at one instant: per pool (load, latency quantiles, queues, KV
  usage, ready/starting/pending pods, per-pod samples with their age) and the router's client-visible TTFT and
  ITL. Every value may be missing, and every pool says how fresh and how complete its data is.
- `queries` + `collector` (IO): the PromQL behind every signal, in one table, read through
  `prometheus-api-client`; only series of pods that exist now count.
- `model` (pure): per-replica capacity at the SLO learned online from settled replicas with a prior from the
  engine profile; predicted demand; replicas each pool needs; which pool a breach belongs to.
- `policy` (pure): bounds, ratio, GPU budget, fast up / slow down, stabilization, consolidation, tolerance,
  no decision while pods are Pending, fail-static. Produces a `Decision` that explains itself (status,
  events, metrics).
- `core`: `Autoscaler`, the state carried from one tick to the next (learned capacity, demand forecast,
  recommendation history), composing model and policy; the benchmark drives exactly this.
- `actuator`: the pools' replicas written to their StatefulSets' /scale (why there, not a per-role object), and
  the autoscaler's view of the cached Pod objects.
- `loop`: the loops in the operator (which services, when they stop, one tick, failures and backoff).
- `report` + `metrics`: what users read: status fields and conditions (written by the reconcile, the one status
  writer), Events, and `pdserve_autoscaler_*` on the operator's /metrics.
"""
