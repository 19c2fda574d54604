"""What the router discovers engines through, so that it needs no access to Pods.

The router faces clients, and `get pods` would let it (or whoever takes it over) read every Pod of the namespace,
env values included. It needs three facts per engine: its address and readiness (EndpointSlices), its kv-compat
value (a prefill engine is only paired with a decode engine carrying the same one) and its topology domain (a
scorer prefers a prefill engine in the decode engine's rack or zone). The last two are a pod label and a node
label. This module renders the objects that carry them to the router:

- **kv-compat: one headless Service per pool and kv-compat value** (`<name>-<pool>-<value>`), selecting the pool's
  pods that carry the value and labelled with it. The EndpointSlice controller copies a Service's labels onto its
  slices, so every slice the router selects says, maintained by Kubernetes from the pods' own labels, which value
  *all* its endpoints carry: a pod is listed under exactly the value it is labelled with, from the moment it is
  ready, so a rollout can never make the router see an old engine under the new value. The renderer emits a
  Service for the spec's current value and for every value still present among the pool's pods (`Observed`, from
  the operator's informer cache): before a rollout starts (the Services are applied in the wave before the
  StatefulSets) and while old pods remain, including terminating ones that still finish their requests and a
  rollback's pods. A value no pod carries any longer is not rendered, so the operator prunes its Service. If the
  cache is behind, an engine is missing from the router's table for a moment, never listed under a wrong value.
  Values that are not well-formed hashes (a hand-edited pod label) are ignored rather than built into names.
  Weighed and rejected: labels or annotations the operator writes onto EndpointSlices (the EndpointSlice
  controller owns them and rewrites them); a pod -> value map in a ConfigMap (a second source of truth that a
  recreated pod outruns: its new address can be in a slice before the map names it).
- **ownership: the Services the operator owns** (`<name>-router-discovery`, key `services.json`, an
  `OwnedServices`: name -> UID). Labels are no proof: anyone with `edit` in the namespace can create a Service
  carrying the pool's labels (and the kv-compat label), whose slices the EndpointSlice controller makes like any
  other. The router trusts a slice only when the EndpointSlice controller made it (`edit` may not write slices)
  for a Service listed here with the UID in the slice's controller reference, and takes from it only pods named as
  members of the pool's StatefulSet (a Service selects by label, so anyone's pod with the pool's labels would be
  listed by the operator's own Services too; `pdserve.api.router_config`). A Service is listed once the operator
  has created it (the next pass, before its pods can be ready) and while it is rendered. Weighed and rejected:
  letting the router read Services (a wider Role for a client-facing process) and trusting names alone (a Service
  of the pool's name pattern made by someone else, e.g. right after deleting the operator's, would be trusted until
  the operator recreates its own).
- **topology: node labels** (the same ConfigMap, key `nodes.json`, a `NodeTopology`). Slice endpoints carry their
  zone and node name; other domains (a rack, an NVLink domain) are node labels, which only a reader of Nodes sees.
  The operator already watches the engine pods (status), reads the Nodes they run on by name (cached), and
  publishes node -> label values for exactly those nodes; the router's Role may read that one ConfigMap
  (resourceNames). Nodes are read and listed only when a topology label is not one the slices already carry, so
  without a `placement.topologyKey` (zone) nothing is read or published. Per-domain Services were rejected: they
  multiply Services (values x domains) and still need the same node reads. Topology is a soft score: a stale entry
  can cost a cross-rack transfer, never a mismatched pair.
- **KV event ports**: an engine's `--kv-events-config` publisher and replay sockets, per data-parallel rank (vLLM
  offsets both ports by the rank), named `kv-events-<rank>` and `kv-replay-<rank>` on the container and on the
  per-kv-compat Services, so they reach the router in the same slices as the HTTP port (the router's Role needs
  nothing more). The router connects to them; the engines never connect to the router.
- **KV side-channel ports**: the ports a prefill answer may name as `remote_port`. vLLM 0.32's NixlConnector serves
  the handshake of each data-parallel rank's engine core on `VLLM_NIXL_SIDE_CHANNEL_PORT + data_parallel_index`
  (one listener per rank for all its TP workers; `nixl/base_scheduler.py`; older releases spaced ranks by the TP
  size), so a prefill pod of DP size d uses the base port and the d - 1 above it.

All of it is watched by the router (list + watch, no request-time API calls): the API load does not grow with
traffic, only with pod and node changes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from pdserve.api.defaults import EffectiveSpec
from pdserve.api.kvcompat import KV_COMPAT_LABEL, is_kv_compat_hash, kv_compat_hash
from pdserve.api.router_config import (
    NODE_TOPOLOGY_KEY,
    OWNED_SERVICES_KEY,
    SLICE_TOPOLOGY_LABELS,
    ZONE_LABEL,
    KvEventsPortNames,
    NodeTopology,
    OwnedServices,
    RouterControl,
)
from pdserve.api.v1alpha1 import PDService
from pdserve_operator.names import ENGINE_ROLES, INSTANCE_LABEL, ROLE_LABEL, EngineRole, child_name, selector_labels
from pdserve_operator.render.objects import metadata

_EMPTY: Mapping[Any, Any] = MappingProxyType({})


@dataclass(frozen=True)
class Observed:
    """What the renderer needs to know of the cluster beyond the spec (the operator reads it from its cache).

    The default, nothing observed, renders what a fresh PDService needs (`pdserve render` uses it)."""

    kv_compat: Mapping[EngineRole, frozenset[str]] = field(default_factory=lambda: _EMPTY)
    """The kv-compat values the pods of each pool carry now (terminating pods included)."""
    node_labels: Mapping[str, Mapping[str, str]] = field(default_factory=lambda: _EMPTY)
    """Node name -> its labels (at least the topology ones), for the nodes the engine pods run on."""
    services: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    """Service name -> UID, for the Services the PDService controls (the operator's cache)."""
    router_control: RouterControl | None = None
    """The autoscaler's latest router control (its disaggregation threshold, `autoscaler.threshold`); None: it has
    decided nothing yet (the control ConfigMap then publishes the configured threshold)."""


NOTHING_OBSERVED = Observed()


# -------------------------------------------------------------------------------------------------- kv-compat


def kv_compat_values(spec: EffectiveSpec, observed: Observed, role: EngineRole) -> list[str]:
    """The values one pool needs a Service for: the spec's, plus every well-formed one its pods carry."""
    present = {value for value in observed.kv_compat.get(role, frozenset()) if is_kv_compat_hash(value)}
    return sorted(present | {kv_compat_hash(spec)})


def kv_compat_service_name(pds: PDService, role: EngineRole, value: str) -> str:
    """`<name>-<pool>-<value>`: at most 40 + 8 + 13 = 61 characters, a DNS-1035 label."""
    return f"{child_name(pds, role)}-{value}"


def kv_compat_services(
    pds: PDService, spec: EffectiveSpec, observed: Observed, role: EngineRole
) -> list[dict[str, Any]]:
    """One headless Service per kv-compat value of the pool, with the ports the router uses: HTTP and the KV events."""
    services: list[dict[str, Any]] = []
    for value in kv_compat_values(spec, observed, role):
        meta = metadata(pds, kv_compat_service_name(pds, role, value), role)
        meta["labels"][KV_COMPAT_LABEL] = value  # copied onto the slices: what the router pairs by
        selector: dict[str, str] = {**selector_labels(pds, role), KV_COMPAT_LABEL: value}
        services.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": meta,
                "spec": {
                    "clusterIP": "None",
                    "selector": selector,
                    "ports": [
                        {"name": "http", "port": spec.engine.port, "targetPort": "http", "protocol": "TCP"},
                        *(
                            {"name": name, "port": port, "targetPort": name, "protocol": "TCP"}
                            for name, port in kv_event_ports(spec, role)
                        ),
                    ],
                },
            }
        )
    return services


def slice_selector(pds: PDService, role: EngineRole) -> str:
    """The label selector of a pool's per-kv-compat slices. Requiring the kv-compat label leaves out the slices of
    the pool's own headless Service (same instance and role labels, no value)."""
    return f"{INSTANCE_LABEL}={pds.metadata.name},{ROLE_LABEL}={role},{KV_COMPAT_LABEL}"


# --------------------------------------------------------------------------------------------------- topology


def topology_labels(spec: EffectiveSpec) -> list[str]:
    """The labels naming the topology domain the router scores on: the placement's topology key, else the zone."""
    return [spec.placement.topology_key] if spec.placement.topology_key else [ZONE_LABEL]


def node_topology_labels(spec: EffectiveSpec) -> list[str]:
    """The topology labels the slices do not carry: the node labels the operator must read and publish."""
    return [label for label in topology_labels(spec) if label not in SLICE_TOPOLOGY_LABELS]


def discovery_config_map_name(pds: PDService) -> str:
    return f"{child_name(pds, 'router')}-discovery"


def owned_services(pds: PDService, spec: EffectiveSpec, observed: Observed) -> dict[str, str]:
    """The per-kv-compat Services the router may take engines from: those the render produces now that the
    operator has created and controls (`Observed.services`, by UID). A Service created in this pass is listed in
    the next one, before its pods can be ready; one no longer rendered (its last pod gone) is dropped."""
    rendered = {
        kv_compat_service_name(pds, role, value)
        for role in ENGINE_ROLES
        for value in kv_compat_values(spec, observed, role)
    }
    return {name: uid for name, uid in sorted(observed.services.items()) if name in rendered}


def discovery_config_map(pds: PDService, spec: EffectiveSpec, observed: Observed) -> dict[str, Any]:
    """The ConfigMap the router reads besides EndpointSlices: the Services whose slices it trusts (`services.json`)
    and, for the topology labels the slices do not carry, the labels of the nodes engines run on (`nodes.json`:
    only nodes with at least one of them; none when the slices carry every label the router uses). The JSON is
    sorted so an unchanged world renders the same bytes (and the operator applies nothing)."""
    wanted = node_topology_labels(spec)
    nodes = {}
    for node, node_labels in observed.node_labels.items():
        values = {label: node_labels[label] for label in wanted if node_labels.get(label)}
        if values:
            nodes[node] = values
    topology = NodeTopology(nodes=nodes).model_dump(mode="json")
    services = OwnedServices(services=owned_services(pds, spec, observed)).model_dump(mode="json")
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(pds, discovery_config_map_name(pds), "router"),
        "data": {
            NODE_TOPOLOGY_KEY: json.dumps(topology, sort_keys=True, separators=(",", ":")),
            OWNED_SERVICES_KEY: json.dumps(services, sort_keys=True, separators=(",", ":")),
        },
    }


# ------------------------------------------------------------------------------------------------ KV events


def kv_event_port_names(rank: int) -> KvEventsPortNames:
    """The port names of one data-parallel rank's KV event publisher and replay socket."""
    return KvEventsPortNames(events=f"kv-events-{rank}", replay=f"kv-replay-{rank}")


def kv_event_ports(spec: EffectiveSpec, role: EngineRole) -> list[tuple[str, int]]:
    """(name, port) of every KV event socket of a pool's engines (none when events are off)."""
    events = spec.engine.kv_events
    if not events.enabled:
        return []
    ports: list[tuple[str, int]] = []
    for rank in range(spec.pool(role).data_parallel_size):
        names = kv_event_port_names(rank)
        ports.append((names.events, events.port + rank))
        ports.append((names.replay or "", events.replay_port + rank))
    return ports


def kv_events_selector_ports(spec: EffectiveSpec, role: EngineRole) -> list[KvEventsPortNames]:
    """What the router's selector names, one entry per rank (empty when events are off)."""
    if not spec.engine.kv_events.enabled:
        return []
    return [kv_event_port_names(rank) for rank in range(spec.pool(role).data_parallel_size)]


# ------------------------------------------------------------------------------------------ side-channel ports


def side_channel_ports(spec: EffectiveSpec) -> list[int]:
    """The ports a prefill engine may advertise as `remote_port`: the side-channel port plus each DP rank."""
    base = spec.engine.side_channel_port
    return [base + rank for rank in range(spec.pool("prefill").data_parallel_size)]
