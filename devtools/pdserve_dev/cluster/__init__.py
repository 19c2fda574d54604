"""A local Kubernetes cluster for tests, demos and development: real control plane, simulated GPU nodes.

etcd, kube-apiserver, kube-controller-manager and kube-scheduler are the real upstream programs, built from
the Go module proxy (`build`), started on loopback (`cluster`). Nodes are faked by kwok (`topology`) and, when
asked, by a process node that runs pods as local processes (`process_node`, written separately).
"""
