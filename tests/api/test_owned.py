"""Flags and env vars pdserve owns cannot be set in args/env under any spelling vLLM would read as theirs.

vLLM's FlexibleArgumentParser (0.32) maps `_` to `-` in a flag's name, merges dotted keys (`--x.key=v`) into the
JSON of `--x` (appended after every other argument, so they win), and hands the result to argparse, which accepts
any unambiguous abbreviation of a long flag (`--kv-transfer-conf`) and `-tp=2`. A spelling that gets past the check
would override the per-incarnation engine id, TP or the served name the router relies on.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from pdserve.api import owned
from pdserve.api.validation import validate


def pds(
    *,
    engine_args: Sequence[str] = (),
    decode_args: Sequence[str] = (),
    env: Sequence[dict[str, Any]] = (),
    **model: str,
) -> dict[str, Any]:
    return {
        "apiVersion": "pdserve.io/v1alpha1",
        "kind": "PDService",
        "metadata": {"name": "svc"},
        "spec": {
            "model": {"name": "m", "uri": "hf://org/m", **model},
            "engine": {"image": "vllm:1", "args": list(engine_args), "env": list(env)},
            "decode": {"args": list(decode_args)},
        },
    }


OWNED_SPELLINGS = [
    ["--kv_transfer_config={}"],
    ["--kv-transfer-config.engine_id=x"],
    ["--kv-transfer-config.engine_id", "x"],
    ["--kv_transfer_config.kv_role=kv_both"],
    ["--kv-transfer-conf={}"],
    ["--kv-t", "{}"],
    ["--kv-transfer-conf.engine_id=x"],
    ["--max_model_len=5"],
    ["--max-model-l", "5"],
    ["--tensor_parallel_size", "2"],
    ["--tensor-parallel", "2"],
    ["-tp", "2"],
    ["-tp=2"],
    ["-t", "2"],
    ["-tp.x=1"],
    ["-dp", "2"],
    ["--data_parallel_size=2"],
    ["--served_model_name", "x"],
    ["--served", "x"],
    ["--port=9000"],
    ["--po", "9000"],
    ["--host", "127.0.0.1"],
    ["--model", "other"],
    ["--revision=main"],
    ["--block_size=32"],
    ["--max-num-seqs=1"],
    ["--max_num_batched_tokens=1"],
    ["--kv-cache-dtype", "fp8"],
    ["--shutdown_timeout=0"],
    # Abbreviations of several flags, which vLLM refuses at start-up ("ambiguous option"): refused here first.
    ["--max-num", "1"],
    ["--kv-cache", "fp8"],
    # A config file would set flags pdserve does not pass explicitly; serving elsewhere than the engine's port.
    ["--config", "/etc/vllm.yaml"],
    ["--config=/etc/vllm.yaml"],
    ["--uds", "/tmp/s"],
    ["--headless"],
    ["--grpc"],
]
FREE_SPELLINGS = [
    ["--enable-prefix-caching"],
    ["--enable_prefix_caching"],
    ["--model-impl", "vllm"],
    ["--data-parallel-size-local", "1"],
    ["--kv-cache-dtype-skip-layers", "0"],
    ["--config-format", "auto"],
    ["--grpc-port", "50051"],
    ["-O3"],
    ["-pp", "2"],
    ["--compilation-config.level=3"],
    ["--max-log-len", "100"],
    ["--override-generation-config", '{"temperature": 0.5}'],
    ["--chat-template", "{{ '--port' }}"],
    ["-1"],
]


@pytest.mark.parametrize("args", OWNED_SPELLINGS, ids=[" ".join(a) for a in OWNED_SPELLINGS])
def test_every_spelling_of_an_owned_flag_is_refused(args: list[str]) -> None:
    for spec in (pds(engine_args=args), pds(decode_args=["--enforce-eager", *args])):
        problems = validate(spec).problems
        assert len(problems) == 1, problems
        assert problems[0].field in {"spec.engine.args[0]", "spec.decode.args[1]"}
        assert "set by pdserve" in problems[0].message


@pytest.mark.parametrize("args", FREE_SPELLINGS, ids=[" ".join(a) for a in FREE_SPELLINGS])
def test_flags_pdserve_does_not_own_pass(args: list[str]) -> None:
    assert validate(pds(engine_args=args)).problems == ()


def test_the_message_names_the_flag_vllm_would_read_and_the_field_to_use() -> None:
    (problem,) = validate(pds(engine_args=["--kv-transfer-conf.engine_id=x"])).problems
    assert "--kv-transfer-config" in problem.message and "engine_id" in problem.message


@pytest.mark.parametrize(
    "name",
    [
        "PDSERVE_KV_COMPAT",
        "NVIDIA_VISIBLE_DEVICES",
        "UCX_TLS",
        "UCX_NET_DEVICES",
        "VLLM_NIXL_SIDE_CHANNEL_HOST",
        "VLLM_NIXL_SIDE_CHANNEL_PORT",
        "POD_NAME",
        "POD_UID",
        "POD_IP",
        "POD_NAMESPACE",
    ],
)
def test_env_pdserve_relies_on_is_owned(name: str) -> None:
    (problem,) = validate(pds(env=[{"name": name, "value": "x"}])).problems
    assert problem.field == "spec.engine.env[0].name" and "set by pdserve" in problem.message


def test_hf_token_is_owned_only_when_pdserve_sets_it() -> None:
    env = [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "mine", "key": "token"}}}]
    assert validate(pds(env=env)).problems == ()
    (problem,) = validate(pds(env=env, hfTokenSecret="hub")).problems
    assert problem.field == "spec.engine.env[0].name" and "hfTokenSecret" in problem.message


def test_the_owned_flags_are_the_ones_the_renderer_passes() -> None:
    from pdserve_operator.render.engine import engine_args

    parsed, spec = validate(pds()).require()
    passed = {arg for arg in engine_args(parsed, spec, "prefill") if arg.startswith("-")}
    assert passed <= set(owned.OWNED_FLAGS)


def vllm_flags() -> set[str]:
    text = (Path(__file__).parent / "data" / "vllm-0.32-serve-flags.txt").read_text()
    return {line for line in text.splitlines() if line.startswith("-")}


def test_owned_flags_exist_in_vllm() -> None:
    assert set(owned.OWNED_FLAGS) <= vllm_flags()


def test_refusing_every_abbreviation_refuses_no_other_vllm_flag() -> None:
    """No vLLM 0.32 flag is a strict prefix of an owned one, so no abbreviation check can catch a real flag."""
    flags = vllm_flags()
    for flag in sorted(flags - set(owned.OWNED_FLAGS)):
        assert owned.owned_flag(flag) is None, flag


def test_unique_abbreviations_of_owned_flags_are_what_vllm_reads() -> None:
    """Where argparse would expand an abbreviation (exactly one vLLM flag starts with it), it is an owned flag."""
    flags = vllm_flags()
    for flag in owned.OWNED_FLAGS:
        for end in range(2, len(flag)):
            prefix = flag[:end]
            if prefix in {"--", "-"}:
                continue
            matches = [other for other in flags if other.startswith(prefix)]
            if matches == [flag]:
                assert owned.owned_flag(prefix) == flag, prefix
