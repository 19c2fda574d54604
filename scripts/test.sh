#!/usr/bin/env bash
# Runs every check: lint, types, layer contracts, then the whole test suite (unit and local-cluster tiers).
# Extra arguments go to one pytest run, e.g. `scripts/test.sh -m "not cluster"` for the quick tier. Without them the
# suite runs as two lanes at once (docs/development.md, "Two lanes"): the session cluster's tests mostly wait on
# servers (about 57 % of two cores busy when the suite ran in one lane), so the rest runs beside them.
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/install.sh

.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy pdserve operator/pdserve_operator runtime/pdserve_runtime sim/pdserve_sim devtools/pdserve_dev tests bench
.venv/bin/lint-imports
# YAML the repository ships as plain files (the chart's templates are not YAML: the chart tests lint what they
# render, next to `helm lint --strict`), and the Dockerfile.
.venv/bin/yamllint --strict charts examples crds gitops .yamllint.yaml
.venv/bin/hadolint --failure-threshold warning Dockerfile

# The lanes' marker expressions: together they select every test once (tests/test_lanes.py checks it). The first
# lane holds the tests on the session's cluster; the second the rest, and the tests that start a cluster of their
# own (`own_cluster`) or run real vLLM (its session starts a second cluster for the real-vLLM tier).
LANE_CLUSTER="cluster and not own_cluster and not realvllm"
LANE_REST="not (cluster and not own_cluster and not realvllm)"

# pytest exits 5 when a run collects no tests: not a failure of the suite.
pytest_run() {
  local rc=0
  .venv/bin/python -m pytest "$@" || rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests" >&2
    rc=0
  fi
  return "$rc"
}

# tests/conftest.py moves each pytest session into a private network namespace holding only loopback (when root),
# so nothing a test starts can reach beyond this machine, and the two lanes' servers never meet.
if [ "$#" -gt 0 ]; then
  pytest_run "$@"
  exit $?
fi

lane_log="$(mktemp -t pdserve-lane-rest.XXXXXX.log)"
pytest_run -m "$LANE_REST" >"$lane_log" 2>&1 &
rest_pid=$!
trap 'kill "$rest_pid" 2>/dev/null || true' INT TERM
echo "lane 2 (${LANE_REST}) runs beside this one; its output follows this lane's (${lane_log})"
cluster_rc=0
pytest_run -m "$LANE_CLUSTER" || cluster_rc=$?
rest_rc=0
wait "$rest_pid" || rest_rc=$?
echo
echo "=================================== lane 2: ${LANE_REST} ==================================="
cat "$lane_log"
rm -f "$lane_log"
echo "lane 1 (${LANE_CLUSTER}): exit ${cluster_rc}; lane 2 (${LANE_REST}): exit ${rest_rc}"
[ "$cluster_rc" -eq 0 ] && [ "$rest_rc" -eq 0 ]
