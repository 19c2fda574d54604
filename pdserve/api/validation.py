"""Semantic validation of a PDService: the one function `pdserve validate`, the renderer and the operator share.

The CRD schema rejects what it can at admission. `validate` repeats the cross-field rules the CRD enforces with
CEL (`rules.py` is the one table both are generated from, so `pdserve validate` works offline, before anything
reaches a cluster) and adds the ones CEL cannot express. Every problem names the field it is about, in the wire
(camelCase) spelling, and says how to fix it.

Algorithm: parse the document with the pydantic models; if that fails, report each pydantic error as a problem at
its field path and stop (semantic rules need a typed spec). Otherwise resolve the effective spec once, run the
table's rules on every object they apply to, then the Python-only rules in `_RULES`, and collect all problems: a
user fixing a spec wants the whole list at once, not one error per attempt. The result carries the parsed object
and its effective spec, so a caller (the CLI, the renderer, a reconcile) parses and checks a document once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from pdserve.api.defaults import EffectivePool, EffectiveSpec, effective
from pdserve.api.rules import BY_MODEL
from pdserve.api.v1alpha1 import ApiModel, EnvVar, PDService, PDServiceSpec, PoolSpec


@dataclass(frozen=True, order=True)
class Problem:
    """One thing wrong with a spec: where (a dotted field path) and what to do about it."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class InvalidSpecError(ValueError):
    """Raised by `Validated.require` (and so the renderer) for a spec with problems; carries all of them."""

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


@dataclass(frozen=True)
class Validated:
    """What `validate` found: the parsed object, its effective spec and every problem, so no caller parses twice.

    `pds` and `spec` are None only when the document did not parse (then `problems` holds the parse errors); a
    parsed object with semantic problems keeps both, so status can still report what the children run.
    """

    pds: PDService | None
    spec: EffectiveSpec | None
    problems: tuple[Problem, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    def require(self) -> tuple[PDService, EffectiveSpec]:
        """The object and its effective spec, or `InvalidSpecError` with every problem."""
        if self.problems or self.pds is None or self.spec is None:
            raise InvalidSpecError(list(self.problems))
        return self.pds, self.spec


def validate(source: Mapping[str, Any] | PDService) -> Validated:
    """Parse (unless given a parsed PDService) and check a PDService once: every problem, in the order found."""
    if isinstance(source, PDService):
        pds = source
    else:
        try:
            pds = PDService.model_validate(source)
        except ValidationError as exc:
            return Validated(None, None, tuple(sorted(_from_pydantic(exc))))
    spec = effective(pds.spec)
    problems = [*_cross_field(pds.spec, "spec"), *(problem for rule in _RULES for problem in rule(pds.spec, spec))]
    return Validated(pds, spec, tuple(problems))


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


# ------------------------------------------------------------------------------------------- cross-field (table)


def _cross_field(obj: ApiModel, path: str) -> Iterator[Problem]:
    """The rules of `rules.RULES` on `obj` and every object below it, depth first, at their wire paths."""
    for rule in BY_MODEL.get(type(obj), ()):
        if not rule.holds(obj):
            yield Problem(f"{path}.{rule.field}", rule.message)
    for name, info in type(obj).model_fields.items():
        value = getattr(obj, name)
        at = f"{path}.{info.alias or name}"
        if isinstance(value, ApiModel):
            yield from _cross_field(value, at)
        elif isinstance(value, list):
            for index, item in enumerate(value):
                if isinstance(item, ApiModel):
                    yield from _cross_field(item, f"{at}[{index}]")


# --------------------------------------------------------------------------------------------------- Python-only


def _pools(spec: PDServiceSpec, view: EffectiveSpec) -> Iterator[tuple[str, PoolSpec, EffectivePool]]:
    yield "spec.prefill", spec.prefill, view.prefill
    yield "spec.decode", spec.decode, view.decode


def _gpus_cover_parallelism(spec: PDServiceSpec, view: EffectiveSpec) -> Iterator[Problem]:
    for path, pool, resolved in _pools(spec, view):
        tp, dp = resolved.tensor_parallel_size, resolved.data_parallel_size
        if pool.gpus_per_pod is not None and 0 < pool.gpus_per_pod < tp * dp:
            yield Problem(
                f"{path}.gpusPerPod",
                f"{pool.gpus_per_pod} GPUs cannot hold tensorParallelSize {tp} x dataParallelSize {dp} = {tp * dp}; "
                f"set gpusPerPod to at least {tp * dp} or remove it to derive it from the parallelism",
            )


def _decode_tp_multiple(spec: PDServiceSpec, view: EffectiveSpec) -> Iterator[Problem]:
    # The other half of TP pairing (rules.py has prefill TP <= decode TP): decode ranks split a prefill rank's KV
    # heads evenly only when prefill TP divides decode TP. Python-only so stored objects are not newly refused.
    p_tp, d_tp = view.prefill.tensor_parallel_size, view.decode.tensor_parallel_size
    if view.engine.attention != "mla" and p_tp <= d_tp and d_tp % p_tp != 0:
        yield Problem(
            "spec.decode.tensorParallelSize",
            f"decode TP {d_tp} is not a multiple of prefill TP {p_tp}; KV heads cannot be split evenly across "
            "decode ranks; choose a decode TP that prefill TP divides",
        )


def _hub_token_needs_hf(spec: PDServiceSpec, view: EffectiveSpec) -> Iterator[Problem]:
    model = spec.model
    if model.hf_token_secret is not None and not model.uri.startswith("hf://"):
        yield Problem(
            "spec.model.hfTokenSecret",
            "a hub token applies to hf:// models only; remove it or use an hf:// uri",
        )
    if model.uri.startswith("pvc://") and len(model.uri) <= len("pvc://"):
        yield Problem("spec.model.uri", "pvc:// needs a claim name, e.g. pvc://models/llama-3-8b")


def _owned_flags(spec: PDServiceSpec, view: EffectiveSpec) -> Iterator[Problem]:
    sources: list[tuple[str, list[str]]] = [("spec.engine.args", spec.engine.args)]
    sources += [(f"{path}.args", pool.args) for path, pool, _ in _pools(spec, view)]
    for path, args in sources:
        for index, arg in enumerate(args):
            flag = arg.split("=", 1)[0]
            if flag in OWNED_ENGINE_FLAGS:
                yield Problem(f"{path}[{index}]", f"{flag} is set by pdserve; {OWNED_ENGINE_FLAGS[flag]}")


def _owned_env(spec: PDServiceSpec, view: EffectiveSpec) -> Iterator[Problem]:
    sources: list[tuple[str, list[EnvVar]]] = [("spec.engine.env", spec.engine.env)]
    sources += [(f"{path}.env", pool.env) for path, pool, _ in _pools(spec, view)]
    for path, env in sources:
        yield from _duplicate_env(path, env)
        for index, var in enumerate(env):
            if var.name in OWNED_ENV:
                yield Problem(f"{path}[{index}].name", f"{var.name} is set by pdserve; {OWNED_ENV[var.name]}")


def _duplicate_env(path: str, env: Iterable[EnvVar]) -> Iterator[Problem]:
    seen: set[str] = set()
    for index, var in enumerate(env):
        if var.name in seen:
            yield Problem(f"{path}[{index}].name", f"{var.name} is defined twice; keep one definition")
        seen.add(var.name)


def _ports_distinct(spec: PDServiceSpec, view: EffectiveSpec) -> Iterator[Problem]:
    port, side = view.engine.port, view.engine.side_channel_port
    if port == side:
        yield Problem(
            "spec.engine.sideChannelPort",
            f"the NIXL side channel and the HTTP server cannot both use port {port}; pick another sideChannelPort",
        )


def _rdma_consistent(spec: PDServiceSpec, view: EffectiveSpec) -> Iterator[Problem]:
    if view.placement.rdma != "required":
        return
    for path, _, resolved in _pools(spec, view):
        if resolved.gpus_per_pod == 0:
            yield Problem(
                f"{path}.gpusPerPod",
                "gpusPerPod is 0 but placement.rdma is required; GPU-less engines cannot use GPUDirect RDMA; "
                "set placement.rdma=off for CPU engines",
            )


def _gpu_budget_covers_minimums(spec: PDServiceSpec, view: EffectiveSpec) -> Iterator[Problem]:
    # Python-only: the floor depends on derived defaults (gpusPerPod from the parallelism), and a budget lowered
    # below a running service's minimums must not make the stored object unreadable.
    budget = view.autoscaling.max_gpus
    if budget is None:
        return
    floor = sum(
        (resolved.autoscaling.min_replicas if resolved.autoscaling.enabled else resolved.replicas)
        * resolved.gpus_per_pod
        for _, _, resolved in _pools(spec, view)
    )
    if floor > budget:
        yield Problem(
            "spec.autoscaling.maxGpus",
            f"maxGpus {budget} is below the {floor} GPUs both pools need at their minimum (minReplicas, or replicas "
            "when not autoscaled, x gpusPerPod); raise maxGpus or lower the minimums",
        )


_RULES: tuple[Callable[[PDServiceSpec, EffectiveSpec], Iterable[Problem]], ...] = (
    _hub_token_needs_hf,
    _gpus_cover_parallelism,
    _decode_tp_multiple,
    _owned_flags,
    _owned_env,
    _ports_distinct,
    _rdma_consistent,
    _gpu_budget_covers_minimums,
)
