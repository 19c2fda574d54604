"""The one home of test helpers, free of pytest so tests, benchmarks and the demo share them.

- `wait`: `wait_for` (poll a predicate, sync) and `wait_for_async`. A failed assertion inside a predicate
  propagates at once; timing out is a test failure.
- `net`: `free_port`, `free_ports`, the probes `listening` (a TCP port) and `http_ok` (a GET answers 200), and
  `TcpForwarder`, a forwarder a test can cut to play a dependency going away.
- `load`: `Load`, requests through an OpenAI-compatible server (open-loop arrivals, closed-loop streams, trace
  replay) counting what clients saw.
- `metrics`: one Prometheus text parser (`samples`, `series`, `metric_value`, `by_label`, `scrape`) and
  `wait_for_metric`: wait until a server's counter reaches a count, then assert on that exposition.
- `cluster`: `ClusterHelper` (kubectl, apply, pods) over a running cluster.
- `operator`: `OperatorProcess`, the operator as a real subprocess.
- `sim`: engine simulators as subprocesses or in the current event loop, and clients of their admin API
  (`set_faults`, `requests_seen`, `health_checks_seen`, `state`).
- `mixed_load`: `MixedLoad`, a steady mix of streaming/non-streaming, long (PD) and short requests through a
  router, each answer checked to the token and counted as succeeded, failed_told, lost or bad_tokens.
- `prometheus`: `PrometheusHelper`, PromQL against the local cluster's real Prometheus.
- `examples`: the cluster policy the shipped examples are written for.

How tests wait: for a counted event (a request counter, a table version, a probe count), then assert; never
sleep and then assert that something did not happen, never bound wall-clock time on a shared CPU.
"""
