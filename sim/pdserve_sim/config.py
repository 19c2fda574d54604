"""The simulator's configuration: one frozen dataclass built by the CLI (or by tests directly)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Literal

from pdserve_sim.kvevents import KvEventsConfig
from pdserve_sim.kvstore import StoreSettings
from pdserve_sim.presets import FAST, PRESETS, TimingParams

Role = Literal["prefill", "decode", "both"]
FailurePolicy = Literal["fail", "recompute"]


@dataclass(frozen=True, slots=True)
class FaultConfig:
    """Faults active from startup (the admin endpoint ``/sim/faults`` changes them at run time)."""

    fail_next: int = 0
    fail_status: int = 503
    latency_s: float = 0.0
    stall_after_tokens: int | None = None
    disconnect_after_tokens: int | None = None
    drop_side_channel: bool = False
    unready: bool = False
    crash_after_requests: int | None = None


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Everything one simulated engine needs to know."""

    role: Role = "both"
    model: str = "sim-model"
    #: Names the engine answers to (vLLM's --served-model-name); defaults to [model].
    served_model_names: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    #: Host advertised to decode engines in kv_transfer_params.remote_host.
    side_channel_host: str = "127.0.0.1"
    #: Host the side-channel server binds (defaults to the HTTP bind host).
    side_channel_bind_host: str | None = None
    side_channel_port: int = 5600
    engine_id: str = "sim-engine"
    kv_compat_id: str = ""
    kv_lease_seconds: float = 30.0
    kv_load_failure_policy: FailurePolicy = "fail"
    #: How long decode keeps retrying an unreachable prefill engine before giving up on a KV pull.
    kv_transfer_timeout_s: float = 5.0
    #: Modelled one-time handshake with each new prefill peer before its first pull (divided by speed).
    kv_handshake_s: float = 0.0
    timing: TimingParams = FAST
    fast: bool = True
    speed: float = 1.0
    tensor_parallel_size: int = 1
    #: vLLM's --shutdown-timeout: on SIGTERM refuse new requests and let in-flight ones finish for up to this
    #: long (0 = abort them at once, vLLM's default).
    shutdown_timeout_s: float = 0.0
    #: vLLM's --enable-prompt-tokens-details: usage reports prompt_tokens_details.cached_tokens.
    prompt_tokens_details: bool = False
    #: vLLM's --enable-request-id-headers: responses carry an X-Request-Id header.
    request_id_headers: bool = False
    #: Mean natural output length (EOS) of requests without ignore_eos; 0 = the model never emits EOS.
    eos_mean_tokens: float = 0.0
    #: vLLM's --kv-events-config: publish the prefix cache's changes over ZMQ (None = off, vLLM's default).
    kv_events: KvEventsConfig | None = None
    faults: FaultConfig = field(default_factory=FaultConfig)
    #: The Mooncake store (vLLM's MooncakeStoreConnector in the kv-transfer-config); None: no store.
    kv_store: StoreSettings | None = None

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name a request's ``model`` field may use."""
        return self.served_model_names or (self.model,)

    @property
    def public_model_name(self) -> str:
        """The name reported in responses and metrics (vLLM reports the first served name)."""
        return self.model_names[0]

    @property
    def effective_kv_compat_id(self) -> str:
        """The id both ends of a KV transfer must share (see :func:`derive_kv_compat_id`)."""
        return self.kv_compat_id or derive_kv_compat_id(self.model, self.timing.block_size, self.timing.max_model_len)


def derive_kv_compat_id(model: str, block_size: int, max_model_len: int) -> str:
    """A KV-compatibility id from what makes KV layouts differ, like vLLM's NIXL handshake hash.

    Engines serving the same model with the same block size and context length derive the same id; set
    ``PDSERVE_KV_COMPAT`` (drop-in mode) or ``--kv-compat-id`` to override it. Tensor parallelism is checked
    separately at the pull (a prefill engine with a larger TP than the decode engine refuses, as vLLM does
    not support that for standard attention), so mixed TP with prefill TP <= decode TP still works.
    """
    text = f"{model}|block_size={block_size}|max_model_len={max_model_len}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def preset(name: str) -> TimingParams:
    """The named timing preset (``cpu-tiny``, ``cpu-tiny-shared``, ``h200-8b``, ``fast``)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(sorted(PRESETS))}") from None
