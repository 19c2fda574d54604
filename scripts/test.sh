#!/usr/bin/env bash
# Runs every check: lint, types, layer contracts, then the whole test suite (unit and local-cluster tiers).
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not cluster"` for the quick tier.
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/install.sh

.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy pdserve operator/pdserve_operator runtime/pdserve_runtime
.venv/bin/lint-imports

# The tests run in a private network namespace holding only a loopback interface: nothing a test starts can
# reach beyond this machine, and the local cluster's pod addresses (198.18.0.0/15, routed to `lo` inside the
# namespace, see pdserve/devcluster/pod_network.py) exist only there. Without the privilege to make one (not
# root), the tests run on the host network and the cluster falls back to loopback pod addresses.
isolated() {
  if [ "$(id -u)" = 0 ] && unshare --net true 2>/dev/null; then
    unshare --net -- bash -c 'ip link set lo up && exec "$@"' isolated "$@"
  else
    echo "warning: cannot create a private network namespace; running tests on the host network" >&2
    "$@"
  fi
}

rc=0
isolated .venv/bin/python -m pytest "$@" || rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests" >&2
  rc=0
fi
exit "$rc"
