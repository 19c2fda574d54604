"""The kv-compat hash changes exactly when something P and D must agree on changes."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.api.defaults import effective
from pdserve.api.kvcompat import kv_compat_hash
from pdserve.api.v1alpha1 import PDServiceSpec


def spec(**engine: Any) -> PDServiceSpec:
    return PDServiceSpec.model_validate(
        {
            "model": {"name": "m", "uri": "hf://org/model", "revision": "abc"},
            "engine": {"image": "vllm/vllm-openai:v0.32.0", **engine},
        }
    )


BASE = kv_compat_hash(effective(spec()))


@pytest.mark.parametrize(
    "change",
    [
        {"image": "vllm/vllm-openai:v0.33.0"},
        {"kvCacheDtype": "fp8"},
        {"blockSize": 32},
        {"maxModelLen": 4096},
    ],
)
def test_engine_inputs_change_hash(change: dict[str, Any]) -> None:
    assert kv_compat_hash(effective(spec(**change))) != BASE


def test_model_and_revision_change_hash() -> None:
    other = spec()
    other.model.revision = "def"
    assert kv_compat_hash(effective(other)) != BASE
    other = spec()
    other.model.uri = "hf://org/other"
    assert kv_compat_hash(effective(other)) != BASE


@pytest.mark.parametrize(
    "same",
    [
        {"blockSize": 16},  # the default, written explicitly
        {"kvCacheDtype": "auto"},
        {"kvConnector": "nixl"},
        {"args": ["--enable-prefix-caching"]},  # not part of KV layout
        {"env": [{"name": "X", "value": "1"}]},
    ],
)
def test_defaults_and_unrelated_fields_keep_hash(same: dict[str, Any]) -> None:
    assert kv_compat_hash(effective(spec(**same))) == BASE


def test_pools_do_not_change_hash() -> None:
    other = spec()
    other.decode.replicas = 7
    other.prefill.tensor_parallel_size = 1
    assert kv_compat_hash(effective(other)) == BASE


def test_hash_is_a_valid_label_value() -> None:
    assert len(BASE) <= 63 and BASE.isalnum()
