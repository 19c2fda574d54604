"""The one home of test helpers, free of pytest so tests, benchmarks and the demo share them.

- `wait`: `wait_for` (poll a predicate, sync) and `wait_for_async`.
- `net`: `free_port`, `free_ports`.
- `metrics`: one Prometheus text parser (`samples`, `metric_value`, `scrape`).
- `cluster`: `ClusterHelper` (kubectl, apply, pods) over a running cluster.
- `operator`: `OperatorProcess`, the operator as a real subprocess.
- `sim`: engine simulators as subprocesses or in the current event loop.
"""
