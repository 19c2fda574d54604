"""The chaos benchmark's machinery (`bench/chaos.py`): faults under a checked load on the local cluster.

- `service`: `ChaosService`, one PDService on the process node (simulator engines with the renderer's vLLM
  command line, the router, the operator as a process) and the faults and reads a scenario needs: scale a pool
  the way an autoscaler does, kill an engine pod, restart the operator or kube-apiserver, count the children the
  operator owns. Shared with the drain end-to-end test (`external_pools_manifest`, `scale`, `wait_pool`).
- `watch`: `MismatchWatcher`, every engine's kv-compat mismatch counter, polled while a rollout mixes values.
- `outcome`: `Outcome` (one scenario's row: the JSON contract's keys, the floors it missed) and the table.
- `scenarios`: the eight scenarios, each bringing the service to its starting shape, running `MixedLoad`
  through the router, striking once the load is steady (and, where the fault needs it, at a moment with work in
  hand), and judging its own floors.
"""
