"""Diff the simulator's `/metrics` against real vLLM's: names, types, label names, label values, buckets.

The simulator (`pdserve sim`) stands in for vLLM in every other test, in the chaos benchmark and in users' wiring
tests, and the autoscaler's queries, the dashboard and the alerts are written against vLLM's metrics. So every
`vllm:` family the simulator exports must be one real vLLM exports, with the same type, the same label names, the
same values of its enumerated labels (`source`, `finished_reason`, `reason`, ...) and, for histograms, the same
bucket bounds (compare engines of one `--max-model-len`: vLLM sizes its token-count buckets by it). Info families
(`*_info`, configuration as labels) are compared by label names only, the simulator's a subset of vLLM's.
Families real vLLM exports that the simulator does not are listed in :data:`NOT_SIMULATED`, each with
why, so a family vLLM adds (or a simulator family dropped) fails the diff until someone decides.

Pure: two exposition texts in, a list of problems out (empty: no drift). `prometheus_client`'s parser reads both.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

PREFIX = "vllm:"
#: Labels whose values name the engine or model, not a category: they differ between any two engines.
IDENTITY_LABELS = frozenset({"engine", "model_name"})
#: Labels the exposition format adds to samples of histograms and summaries.
SAMPLE_LABELS = frozenset({"le", "quantile"})

#: Real vLLM 0.32 families the simulator does not export, and why that is safe (nothing of pdserve reads them).
NOT_SIMULATED: dict[str, str] = {
    "vllm:admission_rejections": "admission control is not modelled (no request is refused for capacity)",
    "vllm:engine_sleep_state": "sleep mode (RL weight swaps) is not modelled",
    "vllm:estimated_flops_per_gpu": "hardware counters of a GPU the simulator does not have",
    "vllm:estimated_read_bytes_per_gpu": "hardware counters of a GPU the simulator does not have",
    "vllm:estimated_write_bytes_per_gpu": "hardware counters of a GPU the simulator does not have",
    "vllm:mm_cache_hits": "no multi-modal inputs",
    "vllm:mm_cache_queries": "no multi-modal inputs",
    "vllm:num_requests_kv_fetch_by_stage": "the stages of decode's asynchronous KV load (waiting_to_start, "
    "in_progress, completed_waiting); the simulator counts the same requests in "
    'num_requests_waiting_by_reason{reason="deferred"}, which is what pdserve reads',
    "vllm:nixl_num_notifications_after_expiry": "late NIXL notifications after a lease expired are not modelled",
    "vllm:prompt_tokens_cached_by_source": "the cached share is exported by source in prompt_tokens_by_source",
    "vllm:request_max_num_generation_tokens": "per-request parameters beyond max_tokens are not modelled",
    "vllm:request_num_preemptions": "preemption is not modelled (the simulator never preempts)",
    "vllm:request_params_n": "per-request parameters beyond max_tokens are not modelled (n is always 1)",
    "vllm:request_prefill_kv_computed_tokens": "exported as prompt_tokens_by_source{source=local_compute}",
}


@dataclass
class Family:
    """What one metric family looks like in an exposition."""

    kind: str
    label_names: set[str] = field(default_factory=set)
    label_values: dict[str, set[str]] = field(default_factory=dict)
    buckets: set[str] = field(default_factory=set)


def families(exposition: str, prefix: str = PREFIX) -> dict[str, Family]:
    """The families of `exposition` whose names start with `prefix`, keyed by family name (counters without
    `_total`, as the parser names them)."""
    found: dict[str, Family] = {}
    for metric in text_string_to_metric_families(exposition):
        # prometheus_client's `<name>_created` series (a counter's or histogram's creation time) are parsed as
        # families of their own; the simulator turns them off. Not metrics anyone queries.
        if not metric.name.startswith(prefix) or metric.name.endswith("_created"):
            continue
        family = found.setdefault(metric.name, Family(metric.type))
        for sample in metric.samples:
            if sample.name.endswith("_created"):
                continue
            for name, value in sample.labels.items():
                if name == "le":
                    family.buckets.add(value)
                if name in SAMPLE_LABELS:
                    continue
                family.label_names.add(name)
                if name not in IDENTITY_LABELS:
                    family.label_values.setdefault(name, set()).add(value)
    return found


def diff(real: str, simulated: str, not_simulated: Iterable[str] = NOT_SIMULATED) -> list[str]:
    """Every way the simulator's exposition differs from real vLLM's (see the module docstring)."""
    real_families, sim_families = families(real), families(simulated)
    allowed = set(not_simulated)
    problems: list[str] = []
    for name in sorted(sim_families.keys() - real_families.keys()):
        problems.append(f"{name}: the simulator exports it, real vLLM does not")
    for name in sorted(real_families.keys() - sim_families.keys() - allowed):
        problems.append(
            f"{name}: real vLLM exports it, the simulator does not (simulate it or list it in NOT_SIMULATED)"
        )
    for name in sorted(allowed & sim_families.keys()):
        problems.append(f"{name}: listed in NOT_SIMULATED but the simulator exports it")
    for name in sorted(real_families.keys() & sim_families.keys()):
        want, got = real_families[name], sim_families[name]
        if want.kind != got.kind:
            problems.append(f"{name}: type {got.kind} in the simulator, {want.kind} in real vLLM")
        if name.endswith("_info"):
            if not got.label_names <= want.label_names:
                problems.append(f"{name}: labels {sorted(got.label_names - want.label_names)} are not vLLM's")
            continue
        if want.label_names and got.label_names and want.label_names != got.label_names:
            problems.append(
                f"{name}: labels {sorted(got.label_names)} in the simulator, {sorted(want.label_names)} in real vLLM"
            )
        for label in sorted(want.label_values.keys() & got.label_values.keys()):
            if want.label_values[label] != got.label_values[label]:
                problems.append(
                    f"{name}: {label} values {sorted(got.label_values[label])} in the simulator, "
                    f"{sorted(want.label_values[label])} in real vLLM"
                )
        if want.buckets and got.buckets and want.buckets != got.buckets:
            problems.append(
                f"{name}: histogram buckets differ: the simulator's {_bounds(got.buckets - want.buckets)} "
                f"are not vLLM's; vLLM's {_bounds(want.buckets - got.buckets)} are missing"
            )
    return problems


def _bounds(values: set[str]) -> str:
    return "[" + ", ".join(sorted(values, key=float)) + "]"
