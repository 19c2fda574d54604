"""A vLLM-compatible prefill/decode engine simulator (``pdserve sim``).

It serves vLLM's OpenAI API (completions and chat, streaming and not), implements vLLM's PD protocol over
NixlConnector (prefill returns ``kv_transfer_params``; decode pulls the KV over a real TCP side channel),
exports vLLM's Prometheus metrics, and models latency with a continuous-batching scheduler. Without a GPU,
it stands in for vLLM engines in router, autoscaler and operator tests and benchmarks.

Modules:
- ``cli``: the ``pdserve sim`` command (native flags, and a drop-in for ``vllm serve MODEL ...``).
- ``config`` / ``presets``: configuration and the timing presets (``cpu-tiny``, ``cpu-tiny-shared``, ``h200-8b``,
  ``fast``).
- ``engine``: the scheduler loop (token budget, chunked prefill, KV blocks, prefix cache, preemption, PD).
- ``kvcache``: the block pool and prefix cache. ``tokenizer``: the tokenizer approximation and the
  deterministic output text. ``protocol``: request validation and vLLM error bodies.
- ``server``: the aiohttp HTTP server. ``sidechannel``: the KV transfer server and client.
- ``metrics``: vLLM's metric names, labels and buckets. ``faults``: fault injection.

Why it ships in the pdserve image (not only in the development tooling): users run PDServices whose engine
image is served by ``pdserve sim serve ...`` to test a cluster's wiring (GitOps sync, network policies, the
router, dashboards, the autoscaler) on CPU nodes before GPUs are attached, as ``examples/local-sim.yaml`` does.
It imports only the shared API, never the router or the operator (import-linter's layers contract).

Python API for tests and benchmarks (``pdserve_dev.testing.sim``, in the development tooling)::

    from pdserve_dev.testing.sim import sim_process, sim_in_process

    async with sim_process(role="prefill", fast=True) as prefill:      # a real subprocess, free ports
        async with sim_process(role="decode", fast=True) as decode:
            ...  # prefill.url, decode.url, prefill.side_channel_port, prefill.kill()

    async with sim_in_process(role="both") as sim:                      # in this event loop, ~ms to start
        ...  # sim.url

``sim_process(**options)`` takes the native CLI flags as keyword arguments (``preset="cpu-tiny"``,
``kv_lease_seconds=1``, ``kv_load_failure_policy="recompute"``, ``fault_fail_next=2``, ...), positional
arguments switch to drop-in mode (``sim_process("serve", "my-model", "--kv-transfer-config", "{...}")``), and
``env=`` adds environment variables (e.g. ``PDSERVE_BIND_HOST``). ``sim_in_process(config, **fields)`` takes
a :class:`~pdserve_sim.config.SimConfig` and field replacements; ``sim_server_in_process`` yields the
``SimServer`` itself (engine state, metrics objects). ``scrape(url)`` and ``metric_value(text, name,
**labels)`` read ``/metrics``.

Benchmarks: ``bench/sim_throughput.py`` (the ``--fast`` performance floor: 500 streams, 20,000 tokens/s,
``--pd`` for the 3-step flow) and ``bench/sim_fidelity.py`` (measured vs modelled TTFT/ITL of the presets).

Self-check: ``pdserve:sim_step_lag_seconds`` and ``pdserve:sim_late_steps_total`` on ``/metrics`` show when
the simulator process itself cannot keep up with its modelled step times (then its latencies are inflated).

Run-time fault injection: ``POST /sim/faults`` with a JSON object of faults (see ``faults``), ``DELETE`` to
clear, ``GET`` to read (with ``requests_seen`` and ``health_checks_seen``, the generation and ``/health``
requests answered so far, so tests can wait for a count). ``GET /sim/state`` shows the scheduler's queues and KV
usage.
"""
