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

from pdserve.api import hostpaths, owned
from pdserve.api.defaults import EffectivePool, EffectiveSpec, effective
from pdserve.api.policy import DEFAULT_POLICY, HOST_PATH_FLAG, Policy
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


def validate(source: Mapping[str, Any] | PDService, policy: Policy = DEFAULT_POLICY) -> Validated:
    """Parse (unless given a parsed PDService) and check a PDService once: every problem, in the order found.

    `policy` is the cluster's (the operator's flags); the default allows nothing beyond the API itself.
    """
    if isinstance(source, PDService):
        pds = source
    else:
        try:
            pds = PDService.model_validate(source)
        except ValidationError as exc:
            return Validated(None, None, tuple(sorted(_from_pydantic(exc))))
    spec = effective(pds.spec)
    problems = [
        *_cross_field(pds.spec, "spec"),
        *(problem for rule in _RULES for problem in rule(pds.spec, spec)),
        *_policy(pds.spec, policy),
    ]
    return Validated(pds, spec, tuple(problems))


# ------------------------------------------------------------------------------------------------ pydantic errors


# A problem quotes the user's input to help find it, never at length: a hostile document (a megabyte-long scalar, a
# list built from YAML aliases) must not turn into megabytes of errors.
_ECHO_LIMIT = 60


def _short(value: object) -> str:
    text = repr(value) if not isinstance(value, (dict, list)) else f"a {type(value).__name__} of {len(value)}"
    return text if len(text) <= _ECHO_LIMIT else text[:_ECHO_LIMIT] + "..."


def _from_pydantic(exc: ValidationError) -> Iterator[Problem]:
    for error in exc.errors():
        path = ".".join(_short(part) if len(str(part)) > _ECHO_LIMIT else str(part) for part in error["loc"])
        message = error["msg"]
        if error["type"] == "extra_forbidden":
            message = "unknown field; check the spelling against `pdserve crd`"
        elif error["type"] == "missing":
            message = "required field is missing"
        elif "input" in error and error["type"] not in {"model_type", "dict_type"}:
            message = f"{message} (got {_short(error['input'])})"
        yield Problem(path or "<root>", message)


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
    # Every token, not only those in flag position: argparse reads any token that looks like a flag as one.
    sources: list[tuple[str, list[str]]] = [("spec.engine.args", spec.engine.args)]
    sources += [(f"{path}.args", pool.args) for path, pool, _ in _pools(spec, view)]
    for path, args in sources:
        for index, arg in enumerate(args):
            problem = owned.flag_problem(arg)
            if problem is not None:
                yield Problem(f"{path}[{index}]", problem)


def _owned_env(spec: PDServiceSpec, view: EffectiveSpec) -> Iterator[Problem]:
    names = owned.owned_env(spec.model.hf_token_secret)
    sources: list[tuple[str, list[EnvVar]]] = [("spec.engine.env", spec.engine.env)]
    sources += [(f"{path}.env", pool.env) for path, pool, _ in _pools(spec, view)]
    for path, env in sources:
        yield from _duplicate_env(path, env)
        for index, var in enumerate(env):
            if var.name in names:
                yield Problem(f"{path}[{index}].name", f"{var.name} is set by pdserve; {names[var.name]}")


def _duplicate_env(path: str, env: Iterable[EnvVar]) -> Iterator[Problem]:
    seen: set[str] = set()
    for index, var in enumerate(env):
        if var.name in seen:
            yield Problem(f"{path}[{index}].name", f"{var.name} is defined twice; keep one definition")
        seen.add(var.name)


def _ports_distinct(spec: PDServiceSpec, view: EffectiveSpec) -> Iterator[Problem]:
    # vLLM's NixlConnector listens on sideChannelPort + the data-parallel rank (one handshake listener per rank), in
    # every engine of both pools; the router accepts exactly those ports from prefill (render.discovery).
    port, side = view.engine.port, view.engine.side_channel_port
    if port == side:
        yield Problem(
            "spec.engine.sideChannelPort",
            f"the NIXL side channel and the HTTP server cannot both use port {port}; pick another sideChannelPort",
        )
        return
    for path, _, resolved in _pools(spec, view):
        last = side + resolved.data_parallel_size - 1
        if last == side:
            continue
        if side <= port <= last or last > 65535:
            clash = f"which includes the HTTP port {port}" if last <= 65535 else "beyond 65535"
            yield Problem(
                "spec.engine.sideChannelPort",
                f"with {path}.dataParallelSize {resolved.data_parallel_size} the NIXL side channels use ports "
                f"{side}-{last} (one per rank), {clash}; pick another sideChannelPort",
            )
            return


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


# vLLM 0.32's CPU platform: its attention backend (CPU_ATTN) takes block sizes that are multiples of 32 ("No common
# block size for 16 (CPU_ATTN: [MultipleOf(32)])" at start-up) and its NixlConnector registers KV buffers in host
# memory only. GPU backends take multiples of 16, with a device or a host (kvBufferDevice cpu) buffer alike, so the
# rule follows the engine's platform (a pool without GPUs), not kvBufferDevice. Python-only: it is a fact of the
# engine version the image holds, not of the API, and the CRD should not have to change when vLLM does.
CPU_BLOCK_MULTIPLE = 32


def _cpu_engines(spec: PDServiceSpec, view: EffectiveSpec) -> Iterator[Problem]:
    cpu_pools = [path for path, _, resolved in _pools(spec, view) if resolved.gpus_per_pod == 0]
    if not cpu_pools:
        return
    which = " and ".join(f"{path}.gpusPerPod" for path in cpu_pools)
    engine = view.engine
    if engine.block_size % CPU_BLOCK_MULTIPLE != 0:
        sizes = [size for size in (32, 64, 128) if size % CPU_BLOCK_MULTIPLE == 0]
        yield Problem(
            "spec.engine.blockSize",
            f"engines without GPUs ({which} is 0) run vLLM's CPU backend, whose attention kernels need a block size "
            f"that is a multiple of {CPU_BLOCK_MULTIPLE}, not {engine.block_size}; set blockSize to "
            f"{', '.join(map(str, sizes[:-1]))} or {sizes[-1]}",
        )
    if engine.kv_buffer_device != "cpu":
        yield Problem(
            "spec.engine.kvBufferDevice",
            f"engines without GPUs ({which} is 0) have no {engine.kv_buffer_device} device for NIXL's KV buffers; "
            "set kvBufferDevice to cpu",
        )


def _kv_tiers_need_gpus(spec: PDServiceSpec, view: EffectiveSpec) -> Iterator[Problem]:
    """vLLM 0.32's OffloadingConnector and MooncakeStoreConnector call CUDA (measured: they fail on the CPU
    platform), so a pool without GPUs can use neither. Python-only: a fact of the engine version, like `_cpu_engines`.
    """
    for path, _, resolved in _pools(spec, view):
        if resolved.gpus_per_pod > 0:
            continue
        if resolved.kv_cache.offload.enabled:
            yield Problem(
                f"{path}.gpusPerPod",
                "engines without GPUs cannot use a KV offload tier (vLLM 0.32's OffloadingConnector needs CUDA); "
                f"give the pool GPUs or set {path}.kvCache.offload.cpuBytes to 0",
            )
        if view.engine.kv_cache.store.enabled:
            yield Problem(
                f"{path}.gpusPerPod",
                "engines without GPUs cannot use a KV store (vLLM 0.32's MooncakeStoreConnector needs CUDA); give "
                "the pool GPUs or remove spec.engine.kvCache.store",
            )


def _policy(spec: PDServiceSpec, policy: Policy) -> Iterator[Problem]:
    """The administrator's decisions (policy.py): node paths as model sources."""
    uri = spec.model.uri
    if not hostpaths.is_node_path(uri) or not hostpaths.is_normalised(uri) or hostpaths.touches_system_path(uri):
        return  # not a node path, or one the rules table already refuses whatever the policy
    if not policy.model_host_paths:
        yield Problem(
            "spec.model.uri",
            "node paths are off on this cluster: an administrator allows folders with `pdserve operator "
            f"{HOST_PATH_FLAG} PREFIX` (`pdserve validate {HOST_PATH_FLAG} PREFIX` checks against them); "
            "or use hf:// or pvc://",
        )
    elif not policy.allows_model_host_path(uri):
        yield Problem(
            "spec.model.uri",
            f"{uri} is not under a folder the administrator allows for model weights "
            f"({', '.join(policy.model_host_paths)}); move the weights there, or use hf:// or pvc://",
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
    _cpu_engines,
    _kv_tiers_need_gpus,
    _gpu_budget_covers_minimums,
)
