"""The process node: a small kubelet stand-in that runs the pods bound to its Node as local processes.

The local test cluster has a real API server, scheduler and controllers but no container runtime (no Docker
engine on these machines). kwok fakes GPU nodes whose pods never run anything; this package is the one node
whose pods really run, so the operator, the router's endpoint discovery and end-to-end tests can talk to real
servers through real EndpointSlices.

Start it with::

    python -m pdserve_dev.process_node --kubeconfig K --node-name NAME --workdir W \\
        [--image-map FILE] [--pod-cidr CIDR] [--no-sandbox]

What it emulates
----------------
* A Node object (label and NoSchedule taint ``pdserve.io/process-node=true``, generous cpu/memory/pods and
  ``nvidia.com/gpu``/``rdma/ib`` capacity, a Ready condition) whose Lease it renews so the node lifecycle
  controller keeps it Ready.
* For each pod bound to that node (a watch with ``spec.nodeName`` as field selector): a unique local IP,
  one process per container in its own process group (working folder: the container's workingDir, else /), logs in
  ``W/logs/<ns>_<pod>_<container>.log`` and PIDs in ``W/pids/<ns>_<pod>_<container>.pid``. Pod IPs come
  from ``--pod-cidr`` (``PDSERVE_POD_CIDR``; the local cluster passes 198.18.0.0/16, which it routes to
  ``lo``) or else from a ``127.B.0.0/16`` block: every 127.x.y.z is local on Linux, but kube-apiserver refuses
  loopback addresses in EndpointSlices, so Services only work with the routed block (see :mod:`.ipam`).
* Container images are mapped to local commands by a small YAML image map (:mod:`.imagemap`); the container's
  command/args/env are kept, ``$(VAR)`` references are expanded like Kubernetes does, downward-API env is
  resolved, and ``PDSERVE_BIND_HOST`` tells our servers which address is "their" pod IP, because all pods
  share the host's network namespace.
* Containers as a runtime makes them (:mod:`.sandbox`, when the node is root, which tests and the demo are):
  each container process gets its own mount and UTS namespace (host name = pod name), a private root whose files
  are the host's (there are no images), its volumes bind-mounted at their mountPaths (mount points the host
  lacks are made without touching the host), a private ``/dev/shm`` and ``/tmp``, the securityContext's user,
  groups and capabilities, ``no_new_privs``, and a recursively read-only root for ``readOnlyRootFilesystem``
  (:mod:`.security` lists what is honoured and reports the rest, see below).
* In-cluster configuration the way a kubelet provides it: the ``kube-api-access-*`` projected volume the
  ServiceAccount admission adds to every pod is materialised, its token requested through the TokenRequest API
  for the pod's ServiceAccount, bound to the pod, and renewed at 80 % of its lifetime (:mod:`.tokens`), its
  ``ca.crt`` from the ``kube-root-ca.crt`` ConfigMap and its ``namespace`` from the downward API; every
  container gets ``KUBERNETES_SERVICE_HOST``/``PORT`` (and the ``KUBERNETES_PORT_443_TCP...`` family) from the
  ``default/kubernetes`` Service, whose ClusterIP the node makes reachable by relaying it to the API server, as
  kube-proxy would (:mod:`.apiservice`). No kubeconfig reaches a container: clients find the API with
  ``pdserve.api.kubeclient``'s in-cluster step, under the pod's own RBAC.
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

Why a mount namespace per container, and not a kubeconfig or rewritten paths
------------------------------------------------------------------------------
Programs look for in-cluster credentials at a fixed path (``/var/run/secrets/kubernetes.io/serviceaccount``) and
for their configuration at their volumeMounts' paths; only a mount namespace puts files there for one process and
not for the host or the next pod. A container is a process in namespaces: ``unshare`` plus bind mounts is what
runc does, minus images and cgroups. So the chart's operator and the renderer's router run unchanged, with their
real securityContext (user 65532, read-only root, no capabilities) and their real RBAC: a permission the chart
forgets, a write outside the ``/tmp`` volume or a library that needs a passwd entry fails here as it would in a
cluster (the last one did: kopf asked ``getpwuid`` for the operator's identity). The TokenRequest route (rather
than a long-lived Secret token) is what kubelets do since Kubernetes 1.22, so tokens are bound to the pod and die
with it. The relay behind the ClusterIP keeps the API server's certificate check honest: in-cluster clients
connect to the address the certificate names, not to a loopback address chosen for the local cluster.

What it does not emulate
------------------------
* No images: the host's files stand in for the image's (the image map says which command an image runs and as
  which user). A container whose root is not read-only writes to the host's files (except ``/tmp`` and
  ``/dev/shm``, which are private). Folders leading to the interpreter that the container's user could not
  enter (``/root`` when Python lives under ``/root/.pyenv``) are made enterable in the container's view. An
  interpreter or checkout under the host's ``/tmp`` is bound back, read-only, below the container's ``/tmp``; with
  a ``/tmp`` volume its (empty) mount point shows in the volume's folder.
* No cgroups or resource limits, no network namespaces: every pod shares the host network, so two pods that
  bind 0.0.0.0 on the same port collide (bind the pod IP; pdserve's operator, router and simulator bind
  ``PDSERVE_BIND_HOST``).
* Reported, not emulated: seccomp and AppArmor profiles, SELinux options, ``procMount``, sysctls,
  ``fsGroupChangePolicy``, added capabilities of a non-root user. Each container whose securityContext asks for
  one of them gets one ``SecurityContextNotEmulated`` event (type Normal) and a log line naming them; it runs
  anyway (the chart's ``seccompProfile: RuntimeDefault`` is the common case). ``runAsNonRoot`` is enforced: a
  container that would run as root fails with the kubelet's ``CreateContainerConfigError`` message.
* Volumes: emptyDir (``medium: Memory`` is a folder too), configMap, secret, downwardAPI and projected volumes
  are materialised at pod start; only projected service account tokens are updated later (configMap and secret
  contents are not). PVCs, hostPath and the rest are skipped with a logged warning.
* Without root (no mount namespaces) the node falls back to the old way and says so at start: the host's file
  system, every command word, argument or env value that starts with a volumeMount's mountPath rewritten to the
  materialised folder, no token volume, no securityContext, and ``KUBECONFIG`` set to the cluster's (admin)
  kubeconfig. ``--no-sandbox`` forces this.
* No exec probes (they count as success; gRPC probes call grpc.health.v1 as the kubelet does), no postStart hooks
  (exec preStop hooks run with the container's environment, outside its sandbox), no service env vars other than the
  ``kubernetes`` Service's (``FOO_SERVICE_HOST``). Sidecars are stopped together with the other containers, not
  after them.
* No kubelet API: ``kubectl logs/exec/attach/port-forward`` do not work; read the log files instead.
* State is minimal and rebuilt from the API on start: pods found running are started again (their old
  processes, found through the PID files, are killed first).
"""
