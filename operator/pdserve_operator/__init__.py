"""The pdserve operator: renders PDService objects into Kubernetes objects and reconciles them.

Layers (imports only go down):

    cli, runner      composition root: client, cache, controller, Lease election, kopf, /metrics, /healthz,
                     and with --prometheus-url the SLO autoscaler's loops (`autoscaler.loop`)
    handlers         kopf registration only: `on.event` for PDServices and every child kind -> controller
    controller       informer cache + de-duplicating work queue + workers + periodic resync, gated by leadership
    autoscaler       the SLO autoscaler: one loop per PDService with a pool it scales (leader only), writing the
                     pools' /scale and leaving its reports for the reconcile to put in status (its docstring)
    reconcile        the one level-triggered path: render -> plan -> apply/prune -> status (IO via `kube`)
    plan, status,    pure: what to apply/prune (`plan`), is an observed child still what we applied (`drift`),
    drift, render    the status and conditions of observed children (`status`), the objects (`render`)
    kube, leader     IO: server-side apply, delete, status patch, events, Lease; every request counted
                     (`kube`, not `api`: `pdserve.api` is the PDService API these objects are rendered from)

Operating notes:
- Install the CRD before starting the operator (kopf resolves resources at start-up and may not pick up a CRD that
  appears later in the same process).
- Fields deliberately left to others: a StatefulSet's `spec.replicas` while its pool's autoscaling is enabled (its
  scaler writes /scale: pdserve's autoscaler in mode pdserve, where the operator also keeps the value within
  [minReplicas, maxReplicas], HPA/KEDA in mode external, where it never changes it; `plan.py`); anything the
  renderer does not set (extra annotations such as `kubectl rollout restart`'s, extra env entries or labels added by
  other managers).
  Every field the renderer sets is restored on the next pass, at the latest after `--resync-seconds`.
- No finalizer: children carry a controller ownerReference and are garbage-collected with their PDService.
- kopf writes no bookkeeping at all (only `on.event` handlers, returning None); its progress/diffbase storage is
  configured to annotations anyway.
- RBAC the operator needs: exactly the list in `charts/pdserve/files/operator-rbac.yaml`, which the chart renders
  and its tests check (`kubectl auth can-i --list` against it). Note that children need `create` as well as
  `patch`: server-side apply of an object that does not exist yet is authorised as a create.
"""
