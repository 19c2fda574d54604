"""The KV-compatibility hash: one value that prefill and decode engines must share to exchange KV cache.

NIXL moves raw KV blocks between engines, so both sides must run the same weights (model and revision), the same
engine build (image), the same connector, and lay out the cache identically (dtype, block size, max length). The
renderer stamps the hash on every engine pod as the `pdserve.io/kv-compat` label and the router only pairs a
prefill pod with a decode pod carrying the same value; during a rollout old and new pods therefore never pair.

Absent fields are hashed by their effective value (`defaults.effective`), so writing a default explicitly does not
roll the pools.
"""

from __future__ import annotations

import hashlib
import json
import re

from pdserve.api.defaults import EffectiveSpec

KV_COMPAT_LABEL = "pdserve.io/kv-compat"
_HASH_LENGTH = 12
_HASH_FORMAT = re.compile(rf"^[0-9a-f]{{{_HASH_LENGTH}}}$")


def kv_compat_inputs(spec: EffectiveSpec) -> dict[str, object]:
    """Everything P and D must agree on, from the effective spec (exposed for tests and debugging)."""
    engine = spec.engine
    return {
        "model": spec.model.uri,
        "revision": spec.model.revision or "",
        "image": engine.image,
        "connector": engine.kv_connector,
        "kvCacheDtype": engine.kv_cache_dtype,
        "blockSize": engine.block_size,
        "maxModelLen": engine.max_model_len or 0,
    }


def kv_compat_hash(spec: EffectiveSpec) -> str:
    """A short, stable, label-safe hash of `kv_compat_inputs`."""
    canonical = json.dumps(kv_compat_inputs(spec), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:_HASH_LENGTH]


def is_kv_compat_hash(value: str) -> bool:
    """True for a value `kv_compat_hash` can produce: what a pod label must look like before anything (an object
    name, a label selector) is built from it. Pod labels can be edited by anyone who may patch pods."""
    return bool(_HASH_FORMAT.match(value))
