"""Semantic validation of a PDService: the one function `pdserve validate`, the renderer and the operator share.

The CRD schema (with CEL rules) rejects what it can at admission. This module repeats those cross-field rules (so
`pdserve validate` works offline, before anything reaches a cluster) and adds the ones a schema cannot express.
Every problem names the field it is about, in the wire (camelCase) spelling, and says how to fix it.

Algorithm: parse the document with the pydantic models; if that fails, report each pydantic error as a problem at
its field path and stop (semantic rules need a typed spec). Otherwise run every rule in `_RULES` in order and
collect all problems: a user fixing a spec wants the whole list at once, not one error per attempt.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from pdserve.api import defaults
from pdserve.api.v1alpha1 import EnvVar, PDService, PDServiceSpec, PoolSpec, Toleration


@dataclass(frozen=True, order=True)
class Problem:
    """One thing wrong with a spec: where (a dotted field path) and what to do about it."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class InvalidSpecError(ValueError):
    """Raised by `parse_or_raise` and the renderer for a spec with problems; carries all of them."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("; ".join(str(p) for p in problems))


# Engine flags pdserve sets itself. Passing them in `args` would silently fight the renderer (the last flag wins in
# argparse), so they are rejected with a pointer to the field that owns them.
OWNED_ENGINE_FLAGS: Mapping[str, str] = {
    "--host": "the operator binds the engine to all interfaces",
    "--port": "use spec.engine.port",
    "--model": "use spec.model.uri",
    "--served-model-name": "use spec.model.name",
    "--revision": "use spec.model.revision",
    "--tensor-parallel-size": "use spec.<pool>.tensorParallelSize",
    "-tp": "use spec.<pool>.tensorParallelSize",
    "--data-parallel-size": "use spec.<pool>.dataParallelSize",
    "-dp": "use spec.<pool>.dataParallelSize",
    "--kv-transfer-config": "use spec.engine.kvConnector",
    "--kv-cache-dtype": "use spec.engine.kvCacheDtype",
    "--block-size": "use spec.engine.blockSize",
    "--max-model-len": "use spec.engine.maxModelLen",
    "--max-num-seqs": "use spec.<pool>.maxNumSeqs",
    "--max-num-batched-tokens": "use spec.<pool>.maxNumBatchedTokens",
}
OWNED_ENV: Mapping[str, str] = {
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "it is set to the pod IP",
    "VLLM_NIXL_SIDE_CHANNEL_PORT": "use spec.engine.sideChannelPort",
    "POD_NAME": "it is set from the downward API",
    "POD_UID": "it is set from the downward API",
    "POD_IP": "it is set from the downward API",
}


def validate(document: Mapping[str, Any]) -> list[Problem]:
    """All problems of a PDService document (a parsed YAML/JSON mapping); empty when it is valid."""
    try:
        pds = PDService.model_validate(document)
    except ValidationError as exc:
        return sorted(_from_pydantic(exc))
    return validate_spec(pds.spec)


def validate_spec(spec: PDServiceSpec) -> list[Problem]:
    """All semantic problems of a typed spec, in rule order."""
    return [problem for rule in _RULES for problem in rule(spec)]


def parse_or_raise(document: Mapping[str, Any]) -> PDService:
    """Parse a document into a PDService, raising `InvalidSpecError` with every problem if it is not valid."""
    problems = validate(document)
    if problems:
        raise InvalidSpecError(problems)
    return PDService.model_validate(document)


# ------------------------------------------------------------------------------------------------ pydantic errors


def _from_pydantic(exc: ValidationError) -> Iterator[Problem]:
    for error in exc.errors():
        path = ".".join(str(part) for part in error["loc"]) or "<root>"
        message = error["msg"]
        if error["type"] == "extra_forbidden":
            message = "unknown field; check the spelling against `pdserve crd`"
        elif error["type"] == "missing":
            message = "required field is missing"
        elif "input" in error and error["type"] not in {"model_type", "dict_type"}:
            message = f"{message} (got {error['input']!r})"
        yield Problem(path, message)


# ---------------------------------------------------------------------------------------------------------- rules


def _pools(spec: PDServiceSpec) -> Iterator[tuple[str, PoolSpec]]:
    yield "spec.prefill", spec.prefill
    yield "spec.decode", spec.decode


def _gpus_cover_parallelism(spec: PDServiceSpec) -> Iterator[Problem]:
    for path, pool in _pools(spec):
        needed = pool.effective_tp() * pool.effective_dp()
        if pool.gpus_per_pod is not None and 0 < pool.gpus_per_pod < needed:
            yield Problem(
                f"{path}.gpusPerPod",
                f"{pool.gpus_per_pod} GPUs cannot hold tensorParallelSize {pool.effective_tp()} x "
                f"dataParallelSize {pool.effective_dp()} = {needed}; set gpusPerPod to at least {needed} or remove "
                "it to derive it from the parallelism",
            )


def _tp_pairing(spec: PDServiceSpec) -> Iterator[Problem]:
    # vLLM's NixlConnector maps each decode rank onto a slice of a prefill rank's KV heads: with standard attention
    # prefill TP may not exceed decode TP, and decode TP must be a whole multiple of it.
    if (spec.engine.attention or defaults.ATTENTION) == "mla":
        return
    p_tp, d_tp = spec.prefill.effective_tp(), spec.decode.effective_tp()
    if p_tp > d_tp:
        yield Problem(
            "spec.prefill.tensorParallelSize",
            f"prefill TP {p_tp} is larger than decode TP {d_tp}, which vLLM's NixlConnector cannot pair for "
            f"standard attention; use prefill TP <= {d_tp} or set spec.engine.attention=mla for MLA models",
        )
    elif d_tp % p_tp != 0:
        yield Problem(
            "spec.decode.tensorParallelSize",
            f"decode TP {d_tp} is not a multiple of prefill TP {p_tp}; KV heads cannot be split evenly across "
            "decode ranks; choose a decode TP that prefill TP divides",
        )


def _autoscaling_bounds(spec: PDServiceSpec) -> Iterator[Problem]:
    for path, pool in _pools(spec):
        scaling = pool.autoscaling
        if scaling is None:
            continue
        low = defaults.AUTOSCALING_MIN if scaling.min_replicas is None else scaling.min_replicas
        high = defaults.AUTOSCALING_MAX if scaling.max_replicas is None else scaling.max_replicas
        if low > high:
            yield Problem(
                f"{path}.autoscaling.minReplicas",
                f"minReplicas {low} is greater than maxReplicas {high}; raise maxReplicas or lower minReplicas",
            )


def _colocation_needs_topology_key(spec: PDServiceSpec) -> Iterator[Problem]:
    placement = spec.placement
    if placement is None:
        return
    # Only an explicit colocation needs a key (mirrors the CRD's CEL rule); the default, preferred, without a key
    # simply means no co-location constraint.
    if placement.colocation in {"required", "preferred"} and placement.topology_key is None:
        yield Problem(
            "spec.placement.topologyKey",
            f"colocation={placement.colocation} needs a topologyKey naming the shared domain, e.g. "
            "topology.kubernetes.io/zone or a rack label; set it or use colocation=none",
        )


def _model_source(spec: PDServiceSpec) -> Iterator[Problem]:
    model = spec.model
    if model.revision is not None and not model.uri.startswith("hf://"):
        yield Problem("spec.model.revision", "revision applies to hf:// models only; remove it or use an hf:// uri")
    if model.hf_token_secret is not None and not model.uri.startswith("hf://"):
        yield Problem(
            "spec.model.hfTokenSecret",
            "a hub token applies to hf:// models only; remove it or use an hf:// uri",
        )
    if model.uri.startswith("pvc://") and len(model.uri) <= len("pvc://"):
        yield Problem("spec.model.uri", "pvc:// needs a claim name, e.g. pvc://models/llama-3-8b")


def _owned_flags(spec: PDServiceSpec) -> Iterator[Problem]:
    sources: list[tuple[str, list[str]]] = [("spec.engine.args", spec.engine.args)]
    sources += [(f"{path}.args", pool.args) for path, pool in _pools(spec)]
    for path, args in sources:
        for index, arg in enumerate(args):
            flag = arg.split("=", 1)[0]
            if flag in OWNED_ENGINE_FLAGS:
                yield Problem(f"{path}[{index}]", f"{flag} is set by pdserve; {OWNED_ENGINE_FLAGS[flag]}")


def _owned_env(spec: PDServiceSpec) -> Iterator[Problem]:
    sources: list[tuple[str, list[EnvVar]]] = [("spec.engine.env", spec.engine.env)]
    sources += [(f"{path}.env", pool.env) for path, pool in _pools(spec)]
    for path, env in sources:
        yield from _duplicate_env(path, env)
        for index, var in enumerate(env):
            if var.name in OWNED_ENV:
                yield Problem(f"{path}[{index}].name", f"{var.name} is set by pdserve; {OWNED_ENV[var.name]}")


def _env_sources(spec: PDServiceSpec) -> Iterator[Problem]:
    # Mirrors EnvVar's CEL rule (and Kubernetes' own check): a non-empty value and valueFrom exclude each other.
    sources: list[tuple[str, list[EnvVar]]] = [("spec.engine.env", spec.engine.env)]
    sources += [(f"{path}.env", pool.env) for path, pool in _pools(spec)]
    for path, env in sources:
        for index, var in enumerate(env):
            if var.value_from is not None and var.value:
                yield Problem(f"{path}[{index}].valueFrom", "set value or valueFrom, not both; remove one of them")


def _tolerations(spec: PDServiceSpec) -> Iterator[Problem]:
    # Mirrors Toleration's CEL rules, which are Kubernetes' pod validation: rendered pod templates must pass it.
    sources: list[tuple[str, list[Toleration]]] = []
    if spec.placement is not None and spec.placement.tolerations is not None:
        sources.append(("spec.placement.tolerations", spec.placement.tolerations))
    sources += [(f"{path}.tolerations", pool.tolerations) for path, pool in _pools(spec)]
    if spec.router is not None:
        sources.append(("spec.router.tolerations", spec.router.tolerations))
    for path, tolerations in sources:
        for index, toleration in enumerate(tolerations):
            at = f"{path}[{index}]"
            if not toleration.key and toleration.operator != "Exists":
                yield Problem(
                    f"{at}.operator",
                    "an empty key needs operator Exists (it then matches every taint); set a key or operator Exists",
                )
            if toleration.operator == "Exists" and toleration.value:
                yield Problem(f"{at}.value", "value must be empty when operator is Exists; remove it or use Equal")
            if toleration.toleration_seconds is not None and toleration.effect != "NoExecute":
                yield Problem(
                    f"{at}.tolerationSeconds",
                    "tolerationSeconds applies to effect NoExecute only; set effect NoExecute or remove it",
                )


def _duplicate_env(path: str, env: Iterable[EnvVar]) -> Iterator[Problem]:
    seen: set[str] = set()
    for index, var in enumerate(env):
        if var.name in seen:
            yield Problem(f"{path}[{index}].name", f"{var.name} is defined twice; keep one definition")
        seen.add(var.name)


def _ports_distinct(spec: PDServiceSpec) -> Iterator[Problem]:
    port = spec.engine.port or defaults.ENGINE_PORT
    side = spec.engine.side_channel_port or defaults.SIDE_CHANNEL_PORT
    if port == side:
        yield Problem(
            "spec.engine.sideChannelPort",
            f"the NIXL side channel and the HTTP server cannot both use port {port}; pick another sideChannelPort",
        )


def _rdma_consistent(spec: PDServiceSpec) -> Iterator[Problem]:
    policy = (spec.placement.rdma if spec.placement else None) or defaults.RDMA_POLICY
    for path, pool in _pools(spec):
        if policy == "required" and pool.effective_gpus() == 0:
            yield Problem(
                f"{path}.gpusPerPod",
                "gpusPerPod is 0 but placement.rdma is required; GPU-less engines cannot use GPUDirect RDMA; "
                "set placement.rdma=off for CPU engines",
            )


_RULES: tuple[Callable[[PDServiceSpec], Iterable[Problem]], ...] = (
    _model_source,
    _gpus_cover_parallelism,
    _tp_pairing,
    _autoscaling_bounds,
    _colocation_needs_topology_key,
    _owned_flags,
    _owned_env,
    _env_sources,
    _tolerations,
    _ports_distinct,
    _rdma_consistent,
)
