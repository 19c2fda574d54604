"""Controls the operator publishes to every router replica: the disaggregation threshold and the TTFT target.

The operator writes the ConfigMap `<pdservice>-router-control` (`routerControl` in the router's config names it),
key `control.json`, a `RouterControl`: the threshold its autoscaler decided (issue 19 item 2) and the service's TTFT
target (`spec.slo.ttftMilliseconds`, the late-binding queue's deadlines). Published there rather than in the router's
own configuration, a change reaches every replica at once and rolls none of them. Each replica watches that one
ConfigMap (list and watch selecting its name, as the router's Role allows) and applies what it says at once: the next
request is planned with the new threshold and queued with the new deadline. When the ConfigMap is absent, or its
content does not parse, or a member is absent, the configured value is used (`policy.disaggregationThresholdTokens`,
`admission.ttftTargetSeconds`), and a malformed one is logged with the reason. So is one the PDService does not
control (`RouterControlSource.owner_uid`: the operator's ConfigMap carries its controller reference): ConfigMap
rights in the namespace must not be enough to move the threshold or the deadlines.
`pdserve_router_disaggregation_threshold` and `pdserve_router_ttft_target_seconds` show the values in use.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

import pydantic
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.api.router_config import ROUTER_CONTROL_KEY, RouterControl, RouterControlSource
from pdserve_runtime.router.discovery.listwatch import ListWatch, Objects
from pdserve_runtime.router.gate import Gate
from pdserve_runtime.router.policy.scheduler import Scheduler

log = logging.getLogger("pdserve.router")


def parse_control(config_map: Mapping[str, Any]) -> RouterControl:
    """The controls a router control ConfigMap publishes; ValueError (saying why) when it holds none."""
    text = (config_map.get("data") or {}).get(ROUTER_CONTROL_KEY)
    if text is None:
        raise ValueError(f"no key {ROUTER_CONTROL_KEY}")
    try:
        return RouterControl.model_validate_json(text)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the document"
        raise ValueError(f"{ROUTER_CONTROL_KEY} is not a router control: {where}: {first['msg']}") from None


class Controls:
    """The controls in use: the published ones where there are good ones, else the configured ones."""

    def __init__(
        self,
        scheduler: Scheduler,
        owner_uid: str | None = None,
        *,
        gate: Gate | None = None,
    ) -> None:
        """`owner_uid`: the UID a published ConfigMap's controller reference must carry (None: any); `gate`: the
        late-binding queue whose TTFT target the control sets (None: the threshold only)."""
        self._scheduler = scheduler
        self._owner_uid = owner_uid
        self._gate = gate
        self.static = scheduler.policy.disaggregation_threshold_tokens
        self.static_ttft_s = gate.ttft_target_s if gate is not None else None
        self.source = "static"  # of the threshold

    def apply(self, objects: Objects) -> None:
        """The control ConfigMap changed (`objects`: it, or nothing when absent)."""
        control, reason = self._published(next(iter(objects.values()), None))
        before = (self._scheduler.threshold, self.source)
        if control is not None and control.disaggregation_threshold is not None:
            value, self.source = control.disaggregation_threshold, "control"
        else:
            value, self.source = self.static, "static"
            reason = reason if control is None else "no threshold published"
        self._scheduler.threshold = value
        if (value, self.source) != before:
            log.info("Applied disaggregation threshold before=%d after=%d source=%s reason=%r", before[0], value,
                     self.source, reason[:200])  # fmt: skip
        if self._gate is not None:
            published = control.ttft_target_seconds if control is not None else None
            ttft = published if published is not None else self.static_ttft_s
            if ttft != self._gate.ttft_target_s:
                log.info("Applied TTFT target before=%s after=%s source=%s", self._gate.ttft_target_s, ttft,
                         "control" if published is not None else "static")  # fmt: skip
                self._gate.ttft_target_s = ttft

    def _published(self, found: Mapping[str, Any] | None) -> tuple[RouterControl | None, str]:
        """The published controls (None when there are no good ones) and why."""
        if found is None:
            return None, "no router control published"
        if (why := self._untrusted(found)) is not None:
            log.warning("Ignored router control configmap=%s reason=%s", found["metadata"]["name"], why)
            return None, f"ignored a router control: {why}"
        try:
            control = parse_control(found)
        except ValueError as exc:
            log.warning("Ignored router control configmap=%s error=%s", found["metadata"]["name"], exc)
            return None, f"ignored a malformed router control: {exc}"
        return control, control.reason

    def _untrusted(self, config_map: Mapping[str, Any]) -> str | None:
        """Why the ConfigMap is not the PDService's own (None: it is, or no owner is required)."""
        if self._owner_uid is None:
            return None
        refs = [
            ref
            for ref in (config_map.get("metadata") or {}).get("ownerReferences") or ()
            if isinstance(ref, Mapping) and ref.get("controller")
        ]
        if len(refs) != 1 or refs[0].get("kind") != "PDService" or refs[0].get("uid") != self._owner_uid:
            return f"not controlled by the PDService (uid {self._owner_uid})"
        return None


class ControlWatch:
    """Watches the router control ConfigMap by name and applies it (`Controls.apply`)."""

    def __init__(self, source: RouterControlSource, controls: Controls, api_client: Any) -> None:
        from kubernetes import client

        self._watch = ListWatch(
            "router-control",
            client.CoreV1Api(api_client).list_namespaced_config_map,
            source.namespace,
            {"field_selector": f"metadata.name={source.name}"},
            controls.apply,
        )

    def start(self) -> None:
        self._watch.start()

    def stop(self) -> None:
        self._watch.stop()


class ControlsCollector(Collector):
    """`pdserve_router_disaggregation_threshold` and `pdserve_router_ttft_target_seconds`: the values this replica
    uses now."""

    def __init__(self, scheduler: Scheduler, gate: Gate | None = None) -> None:
        self._scheduler = scheduler
        self._gate = gate

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "pdserve_router_disaggregation_threshold",
            "Uncached prompt tokens at or above which a request goes through prefill, as this replica uses it now "
            "(published by the operator in the router control ConfigMap, else the configured one).",
            value=self._scheduler.threshold,
        )
        ttft = self._gate.ttft_target_s if self._gate is not None else None
        if ttft is not None:
            yield GaugeMetricFamily(
                "pdserve_router_ttft_target_seconds",
                "The TTFT target that gives queued requests their deadline, as this replica uses it now (published "
                "by the operator in the router control ConfigMap, else the configured one); absent: none.",
                value=ttft,
            )
