"""The pdserve operator: renders PDService objects into Kubernetes objects and reconciles them.

Layers, top to bottom; imports only go down, and modules of one layer never import each other (the operator's
import-linter contracts in pyproject.toml hold this):

    cli, runner          composition root: settings (one table: `pdserve.api.settings`), client, cache,
                         controller, Lease election, kopf, /metrics, /healthz, and with --prometheus-url the SLO
                         autoscaler's loops
    handlers             kopf registration only: `on.event` for PDServices and every child kind -> controller
    controller           informer cache + de-duplicating work queue + workers + periodic resync, gated by leadership
    autoscaler.loop      the SLO autoscaler: one loop per PDService with a pool it scales (leader only): collect ->
                         decide -> actuate -> report, leaving its reports for the reconcile to put in status
    reconcile            the one level-triggered pass: plan -> execute -> status
    executor, kube,      IO: the plan's writes and the status patch (`executor`), server-side apply, delete, events,
    store, leader,       Lease (`kube`, `leader`: every request counted), the informer cache (`store`), node labels
    autoscaler.collector (`nodes`), the autoscaler's Prometheus reads and /scale writes (`autoscaler.collector`,
    autoscaler.actuator  `autoscaler.actuator`)
    render, plan, drift, pure planning: the objects (`render`), what to apply and prune (`plan`), is an observed
    status, autoscaler  child still what we applied (`drift`), the status of observed children given what the spec
                         asks as values (`status`: it never calls the renderer or the autoscaler), the autoscaler's
                         model, policy and reports
    view                 the effective view of a stored PDService: its validation result, once per stored version
    names, kinds,        names and labels of children, the kinds and their REST paths, what was observed of one
    observed, conditions PDService (`observed.Snapshot`), a condition as decided
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
