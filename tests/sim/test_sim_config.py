"""How native flags, vLLM's drop-in command line and the environment become a SimConfig (pure)."""

from __future__ import annotations

import json
from typing import Any

import click
import pytest

from pdserve_sim.cli import build_config, parse_vllm_args
from pdserve_sim.config import derive_kv_compat_id
from pdserve_sim.presets import CPU_TINY, CPU_TINY_SHARED, FAST, H200_8B

NATIVE: dict[str, Any] = {"role": "both", "preset": "cpu-tiny", "fast": False, "speed": 1.0, "port": 8000}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "PDSERVE_BIND_HOST",
        "PDSERVE_KV_COMPAT",
        "VLLM_NIXL_SIDE_CHANNEL_HOST",
        "VLLM_NIXL_SIDE_CHANNEL_PORT",
    ):
        monkeypatch.delenv(name, raising=False)


def dropin(*args: str, **native: Any) -> Any:
    return build_config({**NATIVE, **native}, parse_vllm_args(list(args)))


@pytest.mark.parametrize(
    ("kv_role", "role"),
    [("kv_producer", "prefill"), ("kv_consumer", "decode"), ("kv_both", "both"), (None, "both")],
)
def test_role_comes_from_kv_role(kv_role: str | None, role: str) -> None:
    ktc = {"kv_connector": "NixlConnector", "engine_id": "e1"}
    if kv_role:
        ktc["kv_role"] = kv_role
    cfg = dropin("m", "--kv-transfer-config", json.dumps(ktc), role="decode")
    assert cfg.role == role and cfg.engine_id == "e1"


def test_no_kv_transfer_config_means_both() -> None:
    assert dropin("m").role == "both"


def test_vllm_flags_override_the_preset() -> None:
    cfg = dropin("org/m", "--max-model-len", "4096", "--block-size", "32", "--max-num-seqs", "8",
                 "--served-model-name", "a", "b", "--port", "9000", "--host", "127.0.0.2")  # fmt: skip
    assert cfg.timing.max_model_len == 4096 and cfg.timing.block_size == 32 and cfg.timing.max_num_seqs == 8
    assert cfg.timing.prefill_per_token == CPU_TINY.prefill_per_token
    assert cfg.model == "org/m" and cfg.model_names == ("a", "b") and cfg.public_model_name == "a"
    assert cfg.port == 9000 and cfg.host == "127.0.0.2"
    assert cfg.side_channel_host == "127.0.0.2"


def test_lease_and_failure_policy_from_the_kv_transfer_config() -> None:
    ktc = {"kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"kv_lease_duration": 7}}  # fmt: skip
    cfg = dropin("m", "--kv-transfer-config", json.dumps(ktc))
    assert cfg.kv_load_failure_policy == "recompute" and cfg.kv_lease_seconds == 7


def test_unknown_flags_are_collected() -> None:
    parsed = parse_vllm_args(["m", "--enforce-eager", "--gpu-memory-utilization", "0.8", "--port", "1"])
    assert parsed["ignored"] == ["--enforce-eager", "--gpu-memory-utilization", "0.8"]
    assert parsed["port"] == 1 and parsed["model"] == "m"


def test_kv_compat_id_env_and_derivation(monkeypatch: pytest.MonkeyPatch) -> None:
    a = dropin("org/m", "--block-size", "16", "--max-model-len", "2048")
    b = dropin("org/m", "--block-size", "16", "--max-model-len", "2048", "--tensor-parallel-size", "2")
    c = dropin("org/m", "--block-size", "32", "--max-model-len", "2048")
    assert a.effective_kv_compat_id == b.effective_kv_compat_id == derive_kv_compat_id("org/m", 16, 2048)
    assert c.effective_kv_compat_id != a.effective_kv_compat_id
    monkeypatch.setenv("PDSERVE_KV_COMPAT", "pinned")
    assert dropin("org/m").effective_kv_compat_id == "pinned"


def test_side_channel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert dropin("m").side_channel_port == 5600
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "5601")
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "10.0.0.5")
    cfg = dropin("m")
    assert cfg.side_channel_port == 5601 and cfg.side_channel_host == "10.0.0.5"


def test_bind_host_env_wins_over_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_BIND_HOST", "198.18.0.9")
    cfg = dropin("m", "--host", "0.0.0.0")
    assert cfg.host == "198.18.0.9" and cfg.side_channel_bind_host == "198.18.0.9"
    assert cfg.side_channel_host == "198.18.0.9"


def test_wildcard_host_advertises_loopback() -> None:
    assert build_config(dict(NATIVE, host="0.0.0.0"), {}).side_channel_host == "127.0.0.1"


def test_presets_and_fast() -> None:
    assert build_config(dict(NATIVE, preset="h200-8b"), {}).timing == H200_8B
    assert build_config(dict(NATIVE, preset="cpu-tiny-shared"), {}).timing == CPU_TINY_SHARED
    assert build_config(dict(NATIVE, preset=None), {}).timing == CPU_TINY
    fast = build_config(dict(NATIVE, fast=True), {})
    assert fast.fast and fast.timing == FAST
    assert build_config(dict(NATIVE, preset="fast"), {}).fast
    with pytest.raises(click.BadParameter, match="unknown preset"):
        build_config(dict(NATIVE, preset="gpu-9000"), {})


def test_bad_kv_transfer_config_is_rejected() -> None:
    with pytest.raises(click.BadParameter):
        parse_vllm_args(["m", "--kv-transfer-config", "{nope"])
    with pytest.raises(click.BadParameter):
        parse_vllm_args(["m", "--kv-transfer-config", "[1]"])


@pytest.mark.parametrize(
    ("argv", "routed"),
    [
        (["--role", "decode", "--port", "8001", "--fast"], False),
        (["--fast", "my-model", "--port", "1"], True),
        (["my-model", "--port", "1"], True),
        (["--model", "m", "--kv-transfer-config", "{}"], True),
        (["--model", "m", "--port", "1"], False),
        (["--port=1", "m"], True),
        (["serve", "m"], True),
    ],
)
def test_vllm_style_arguments_are_routed_to_serve(argv: list[str], routed: bool) -> None:
    from pdserve_sim.cli import route_vllm_args, sim

    native = {opt for param in sim.params for opt in getattr(param, "opts", [])}
    flags = {opt for p in sim.params if isinstance(p, click.Option) and p.is_flag for opt in p.opts}
    assert ("serve" in route_vllm_args(argv, native, flags)) == routed


def test_modelled_vllm_feature_flags() -> None:
    cfg = dropin("m", "--enable-prompt-tokens-details", "--enable-request-id-headers")
    assert cfg.prompt_tokens_details and cfg.request_id_headers
    plain = dropin("m")
    assert not plain.prompt_tokens_details and not plain.request_id_headers


def _multi(role: str, *children: dict[str, Any]) -> str:
    return json.dumps(
        {
            "kv_connector": "MultiConnector",
            "kv_role": role,
            "engine_id": "top",
            "kv_connector_extra_config": {"connectors": list(children)},
        }
    )


def test_a_multi_connector_is_read_through_its_nixl_entry() -> None:
    """The renderer's MultiConnector (NIXL first, then tiers): role, engine id, lease and policy are NIXL's."""
    nixl = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer",
        "engine_id": "pod-uid",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kv_lease_duration": 7},
    }
    offload = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": {}}
    cfg = dropin("m", "--kv-transfer-config", _multi("kv_producer", nixl, offload))
    assert (cfg.role, cfg.engine_id, cfg.kv_lease_seconds, cfg.kv_load_failure_policy) == (
        "prefill",
        "pod-uid",
        7.0,
        "recompute",
    )
    assert cfg.kv_store is None  # an offload tier is accepted, not modelled


def test_the_store_entry_reads_the_mooncake_client_file(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "mooncake.json"
    config.write_text(json.dumps({"master_server_address": "m:1", "metadata_server": "http://m:2/metadata"}))
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(config))
    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
    store = {
        "kv_connector": "MooncakeStoreConnector",
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"cache_prefix": "p"},
    }
    cfg = dropin("m", "--kv-transfer-config", _multi("kv_consumer", nixl, store))
    assert cfg.role == "decode" and cfg.engine_id == "top"
    assert cfg.kv_store is not None
    assert (cfg.kv_store.master_address, cfg.kv_store.cache_prefix, cfg.kv_store.writes) == ("m:1", "p", False)


def test_a_store_without_its_client_file_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    store = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
    with pytest.raises(click.ClickException, match="MOONCAKE_CONFIG_PATH"):
        dropin("m", "--kv-transfer-config", _multi("kv_producer", store))
