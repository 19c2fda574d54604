"""Controls the operator publishes to every router replica (issue 19 item 2): the disaggregation threshold.

The operator's autoscaler writes the ConfigMap `<pdservice>-router-control` (`routerControl` in the router's
config names it), key `control.json`, a `RouterControl`. Each replica watches that one ConfigMap (list and watch
selecting its name, as the router's Role allows) and applies what it says at once: the next request is planned
with the new threshold. When the ConfigMap is absent, or its content does not parse, the configured static
threshold (`policy.disaggregationThresholdTokens`) is used, and a malformed one is logged with the reason. So is
one the PDService does not control (`RouterControlSource.owner_uid`: the operator's ConfigMap carries its
controller reference): ConfigMap rights in the namespace must not be enough to move the threshold.
`pdserve_router_disaggregation_threshold` shows the value in use.
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


class Threshold:
    """The threshold in use: the published one when there is a good one, else the static one."""

    def __init__(self, scheduler: Scheduler, owner_uid: str | None = None) -> None:
        """`owner_uid`: the UID a published ConfigMap's controller reference must carry (None: any)."""
        self._scheduler = scheduler
        self._owner_uid = owner_uid
        self.static = scheduler.policy.disaggregation_threshold_tokens
        self.source = "static"

    def apply(self, objects: Objects) -> None:
        """The control ConfigMap changed (`objects`: it, or nothing when absent)."""
        before = (self._scheduler.threshold, self.source)
        found = next(iter(objects.values()), None)
        if found is None:
            value, self.source, reason = self.static, "static", "no router control published"
        elif (why := self._untrusted(found)) is not None:
            value, self.source, reason = self.static, "static", f"ignored a router control: {why}"
            log.warning("Ignored router control configmap=%s reason=%s", found["metadata"]["name"], why)
        else:
            try:
                control = parse_control(found)
            except ValueError as exc:
                value, self.source, reason = self.static, "static", f"ignored a malformed router control: {exc}"
                log.warning("Ignored router control configmap=%s error=%s", found["metadata"]["name"], exc)
            else:
                value, self.source, reason = control.disaggregation_threshold, "control", control.reason
        self._scheduler.threshold = value
        if (value, self.source) != before:
            log.info("Applied disaggregation threshold before=%d after=%d source=%s reason=%r", before[0], value,
                     self.source, reason[:200])  # fmt: skip

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
    """Watches the router control ConfigMap by name and applies it (`Threshold.apply`)."""

    def __init__(self, source: RouterControlSource, threshold: Threshold, api_client: Any) -> None:
        from kubernetes import client

        self._watch = ListWatch(
            "router-control",
            client.CoreV1Api(api_client).list_namespaced_config_map,
            source.namespace,
            {"field_selector": f"metadata.name={source.name}"},
            threshold.apply,
        )

    def start(self) -> None:
        self._watch.start()

    def stop(self) -> None:
        self._watch.stop()


class ThresholdCollector(Collector):
    """`pdserve_router_disaggregation_threshold`: the threshold this replica uses now."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "pdserve_router_disaggregation_threshold",
            "Uncached prompt tokens at or above which a request goes through prefill, as this replica uses it now "
            "(published by the operator in the router control ConfigMap, else the configured one).",
            value=self._scheduler.threshold,
        )
