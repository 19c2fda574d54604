"""Real vLLM for the `realvllm` test tier: the engine's own virtualenv, the tiny models it serves, and helpers.

The product's promises are about vLLM (that it accepts the rendered command line, that NIXL moves the KV, that the
autoscaler's PromQL finds data in vLLM's metrics, that drain works with vLLM's own shutdown), so the `realvllm` tier
(`tests/realvllm/`) runs them against PyPI's CPU build of vLLM instead of the simulator:

- :mod:`.install`: the pinned virtualenv under the project's cache folder (`python -m pdserve_dev.realvllm install`,
  called by `scripts/install.sh`);
- :mod:`.models`: the tiny random Llama built once into a Hugging Face cache folder (no model can be downloaded);
- :mod:`.engine`: one engine as a local process (outside the cluster), for the metrics diff and the fidelity bench;
- :mod:`.argcheck`: the rendered command lines parsed by the installed vLLM's own argument parser.

Files run by the engine's interpreter, never imported by pdserve: `vllm_launcher.py`, `build_model.py`,
`argcheck_main.py`. docs/real-vllm.md documents the tier and every vLLM workaround.
"""
