"""The process node: a small kubelet stand-in that runs the pods bound to its Node as local processes.

The local test cluster has a real API server, scheduler and controllers but no container runtime (no Docker
engine on these machines). kwok fakes GPU nodes whose pods never run anything; this package is the one node
whose pods really run, so the operator, the router's endpoint discovery and end-to-end tests can talk to real
servers through real EndpointSlices.

Start it with::

    python -m pdserve_dev.process_node --kubeconfig K --node-name NAME --workdir W \\
        [--image-map FILE] [--pod-cidr CIDR]

What it emulates
----------------
* A Node object (label and NoSchedule taint ``pdserve.io/process-node=true``, generous cpu/memory/pods and
  ``nvidia.com/gpu``/``rdma/ib`` capacity, a Ready condition) whose Lease it renews so the node lifecycle
  controller keeps it Ready.
* For each pod bound to that node (a watch with ``spec.nodeName`` as field selector): a unique local IP,
  one process per container in its own process group, cwd = a per-pod folder, logs in
  ``W/logs/<ns>_<pod>_<container>.log`` and PIDs in ``W/pids/<ns>_<pod>_<container>.pid``. Pod IPs come
  from ``--pod-cidr`` (``PDSERVE_POD_CIDR``; the local cluster passes 198.18.0.0/16, which it routes to
  ``lo``) or else from a ``127.B.0.0/16`` block: every 127.x.y.z is local on Linux, but kube-apiserver refuses
  loopback addresses in EndpointSlices, so Services only work with the routed block (see :mod:`.ipam`).
* Container images are mapped to local commands by a small YAML image map (:mod:`.imagemap`); the container's
  command/args/env are kept, ``$(VAR)`` references are expanded like Kubernetes does, downward-API env is
  resolved, and ``PDSERVE_BIND_HOST`` tells our servers which address is "their" pod IP, because all pods
  share the host's network namespace.
* Init containers (run in order to completion; sidecars, i.e. init containers with restartPolicy Always,
  start in order and keep running), restartPolicy Always/OnFailure/Never with CrashLoopBackOff (10 s
  doubling to 5 min), startup/readiness/liveness probes of type httpGet and tcpSocket.
* Pod status through the ``status`` subresource: phase, podIP(s), hostIP, startTime, the usual conditions,
  container statuses with state/lastState/restartCount/ready/started, so the real EndpointSlice controller
  publishes reachable endpoints.
* Graceful deletion like the kubelet's: each container's ``preStop`` hook (sleep, exec, httpGet; :mod:`.lifecycle`)
  within the grace period, then SIGTERM to the process group with what is left of it (at least 2 s), SIGKILL
  when it is up; readiness keeps being probed and the status reported meanwhile (liveness and startup probes
  stop), then the pod object is deleted with grace period 0.

What it does not emulate
------------------------
* No images, no filesystem isolation, no cgroups or resource limits, no users, no network namespaces: every
  pod shares the host network, so two pods that bind 0.0.0.0 on the same port collide (bind the pod IP).
* Volumes: emptyDir, configMap, secret, downwardAPI and the configMap/secret/downwardAPI sources of projected
  volumes are materialised once, at pod start, into the pod folder (no live updates). Processes cannot mount,
  so any command word, argument or env value that starts with a volumeMount's mountPath (also ``--flag=PATH``)
  is rewritten to the materialised folder; paths built at run time inside the program (or inside a
  ``sh -c`` script) are not. Service account tokens are skipped silently (every pod has one); PVCs,
  hostPath and the rest are skipped with a logged warning.
* No exec or gRPC probes (they count as success), no postStart hooks (exec preStop hooks run on the host with
  the container's environment), no service env vars
  (``FOO_SERVICE_HOST``), no in-cluster API config: processes inherit the process node's environment with
  ``KUBECONFIG`` set to the cluster's kubeconfig instead (and ``HOSTNAME`` set to the pod name, as a
  container runtime would). Sidecars are stopped together with the other containers, not after them.
* No kubelet API: ``kubectl logs/exec/attach/port-forward`` do not work; read the log files instead.
* State is minimal and rebuilt from the API on start: pods found running are started again (their old
  processes, found through the PID files, are killed first).
"""
