"""pdserve's development tooling: the local cluster, the process node, the demo and the test helpers.

A separate distribution (`pdserve-dev`, folder `devtools/`) so the production wheel and image carry none of it
(nor `cryptography`, which only the cluster's PKI needs). It sits above the operator, the runtime and the engine
simulator in the layers contract (`pyproject.toml`): it may start or import them, they never import it.

Packages:
- `cluster`: the local Kubernetes cluster (`pdserve dev cluster ...`): build, PKI, processes, topology, netns.
- `process_node`: a small kubelet that runs pods bound to it as local processes.
- `demo`: `pdserve dev demo`, the whole product on one machine.
- `testing`: the one home of test helpers (waiting, ports, metrics, cluster, operator and simulator harnesses),
  shared by `tests/`, `bench/` and the demo.
"""
