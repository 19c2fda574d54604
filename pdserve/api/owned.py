"""Engine flags and environment variables pdserve owns, under every spelling vLLM reads as theirs.

The renderer passes its own flags first and the user's `args` after them, and argparse keeps the last value: a
user flag that reaches an owned one silently breaks a guarantee (the per-incarnation NIXL engine id inside
`--kv-transfer-config`, TP, the served name the router asks for). vLLM 0.32's FlexibleArgumentParser reads far
more spellings than the canonical one, so the check reads a token as vLLM does (`flag_name`):

1. everything from the first `=` is the value (`--port=9000`);
2. for a `--` flag, `_` reads as `-` up to the first `.` (`--max_model_len`);
3. a dotted flag sets a key inside the JSON of the flag before the first `.` (`--kv-transfer-config.engine_id=x`),
   and vLLM appends the merged JSON after every other argument, so it wins over pdserve's;
4. argparse accepts any abbreviation of a flag that no other flag shares (`--kv-transfer-conf`, `-t` for `-tp`);
   an abbreviation several flags share is refused by vLLM at start-up ("ambiguous option").

`owned_flag` refuses a token when its name is an owned flag or any abbreviation of one. Refusing an abbreviation
vLLM would find ambiguous loses nothing (vLLM refuses it too), and no vLLM 0.32 flag is itself a strict prefix of
an owned flag (tests/api/test_owned.py checks both against vLLM 0.32's full list of `vllm serve` flags), so no
real flag is refused by accident.

Beyond the flags the renderer passes, three kinds are owned because they would undo what pdserve set up:
`--config FILE` (a YAML file of flags, applied before the command line's: it could set any owned flag pdserve
does not pass explicitly), and `--uds`, `--headless`, `--grpc` (the engine would stop serving HTTP on its port).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType

OWNED_FLAGS: Mapping[str, str] = MappingProxyType(
    {
        "--host": "the engine listens on every interface of its pod",
        "--port": "use spec.engine.port",
        "--model": "use spec.model.uri",
        "--served-model-name": "use spec.model.name",
        "--revision": "use spec.model.revision",
        "--tensor-parallel-size": "use spec.<pool>.tensorParallelSize",
        "-tp": "use spec.<pool>.tensorParallelSize",
        "--data-parallel-size": "use spec.<pool>.dataParallelSize",
        "-dp": "use spec.<pool>.dataParallelSize",
        "--kv-transfer-config": (
            "it carries the NIXL engine id unique to each pod incarnation; use spec.engine.kvConnector, "
            "kvBufferDevice, kvLeaseSeconds and kvLoadFailurePolicy"
        ),
        "--kv-events-config": "use spec.engine.kvEvents (the router subscribes to the endpoints pdserve renders)",
        "--kv-offloading-size": (
            "it replaces the KV connector, dropping NIXL (prefill -> decode transfer); use "
            "spec.engine.kvCache.offload, which pdserve composes with NIXL"
        ),
        "--kv-offloading-backend": "use spec.engine.kvCache.offload (or kvCache.store for a shared store)",
        "--kv-cache-dtype": "use spec.engine.kvCacheDtype",
        "--block-size": "use spec.engine.blockSize",
        "--max-model-len": "use spec.engine.maxModelLen",
        "--max-num-seqs": "use spec.<pool>.maxNumSeqs",
        "--max-num-batched-tokens": "use spec.<pool>.maxNumBatchedTokens",
        "--shutdown-timeout": "use spec.engine.drainSeconds (the pod's grace period is sized from it)",
        "--config": "a config file could set flags pdserve owns; pass the flags you need in args",
        "--uds": "the router and the probes reach the engine over HTTP on spec.engine.port",
        "--headless": "the router and the probes reach the engine over HTTP on spec.engine.port",
        "--grpc": "the router and the probes reach the engine over HTTP on spec.engine.port",
    }
)

# Set by the renderer (engine.py) and relied on by NIXL, the router or the node.
OWNED_ENV: Mapping[str, str] = MappingProxyType(
    {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "it is set to the pod IP",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "use spec.engine.sideChannelPort",
        "UCX_TLS": "use spec.engine.ucx.transports",
        "UCX_NET_DEVICES": "use spec.engine.ucx.netDevices",
        "PDSERVE_KV_COMPAT": "it is the kv-compat hash the router pairs engines by",
        "MOONCAKE_CONFIG_PATH": "it points at the store client config pdserve renders; use spec.engine.kvCache.store",
        "MOONCAKE_PREFERRED_SEGMENT": "the store's memory is placed by pdserve; use spec.engine.kvCache.store",
        "POD_NAME": "it is set from the downward API",
        "POD_UID": "it is set from the downward API",
        "POD_IP": "it is set from the downward API",
        "POD_NAMESPACE": "it is set from the downward API",
        # The GPU device plugin sets these to the pod's own devices; `all` would, under the NVIDIA container
        # runtime, hand the container every GPU (or MIG control) of the node.
        "NVIDIA_VISIBLE_DEVICES": "the device plugin sets it to the pod's GPUs; use gpusPerPod",
        "NVIDIA_MIG_CONFIG_DEVICES": "it would grant MIG configuration of the node's GPUs",
        "NVIDIA_MIG_MONITOR_DEVICES": "it would grant MIG monitoring of the node's GPUs",
    }
)
HF_TOKEN = "HF_TOKEN"

_NUMBER = re.compile(r"-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def flag_name(token: str) -> str | None:
    """The flag vLLM 0.32 sees in one argument, before abbreviations are expanded; None for a value."""
    if not token.startswith("-") or token in {"-", "--"} or _NUMBER.fullmatch(token):
        return None
    name = token.split("=", 1)[0]
    if name.startswith("--"):
        return "--" + name[2:].split(".", 1)[0].replace("_", "-")
    return name.split(".", 1)[0]


def owned_flag(token: str) -> str | None:
    """The owned flag (or flags, joined by "or") that `token` sets or abbreviates; None if it reaches none."""
    name = flag_name(token)
    if name is None:
        return None
    if name in OWNED_FLAGS:
        return name
    long = name.startswith("--")
    reached = sorted(flag for flag in OWNED_FLAGS if flag.startswith(name) and flag.startswith("--") == long)
    return " or ".join(reached) or None


def flag_problem(token: str) -> str | None:
    """Why `token` may not be in args (naming the field to use instead), or None."""
    flag = owned_flag(token)
    if flag is None:
        return None
    why = "; ".join(dict.fromkeys(OWNED_FLAGS[name] for name in flag.split(" or ")))
    if token.split("=", 1)[0] == flag:
        return f"{flag} is set by pdserve; {why}"
    shown = token if len(token) <= 60 else token[:60] + "..."
    return (
        f"{shown!r} reaches {flag} in vLLM (it reads '_' as '-', dotted keys as keys of the flag's JSON and "
        f"abbreviations as the whole flag), which is set by pdserve; {why}"
    )


def owned_env(hf_token_secret: str | None) -> Mapping[str, str]:
    """Env names the user may not set; HF_TOKEN only when pdserve sets it from spec.model.hfTokenSecret."""
    if hf_token_secret is None:
        return OWNED_ENV
    return {**OWNED_ENV, HF_TOKEN: "it is set from spec.model.hfTokenSecret; remove one of them"}
