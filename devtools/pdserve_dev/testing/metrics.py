"""Reading Prometheus text expositions in tests, benchmarks and the demo: one parser for all of them.

It goes through prometheus_client's public parser only (never a registry's private attributes), so what a test
reads is exactly what Prometheus would scrape.
"""

from __future__ import annotations

import urllib.request

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from pdserve_dev.testing.wait import wait_for, wait_for_async


def samples(exposition: str) -> dict[str, float]:
    """Every sample as `name{label="v",...}` -> value (labels sorted), or `name` when it has no labels."""
    result: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            result[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return result


def metric_value(exposition: str, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`.

    Example: `metric_value(text, "vllm:prompt_tokens_by_source_total", source="local_compute")`.
    """
    total = 0.0
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def series(exposition: str, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
    """Every sample called `name` whose labels include `labels`, as (labels, value), in exposition order.

    Unlike `samples`, two samples with the same labels stay two entries: a test can count them.
    """
    return [
        (dict(sample.labels), sample.value)
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    ]


def by_label(exposition: str, name: str, label: str) -> dict[str, float]:
    """Samples called `name` summed per value of `label` (e.g. prompt tokens by `source`)."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == name:
                key = sample.labels.get(label, "")
                totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def scrape_sync(url: str, timeout: float = 10.0) -> str:
    """The exposition at `url` (a full URL, e.g. `http://host:port/metrics`)."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return str(response.read().decode())


async def scrape(url: str) -> str:
    """The `/metrics` exposition of the server at base URL `url`."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
        resp.raise_for_status()
        return await resp.text()


async def wait_for_metric(url: str, name: str, at_least: float, within: float = 10.0, **labels: str) -> str:
    """Scrape the server at base URL `url` until `metric_value(..., name, **labels)` reaches `at_least`; return
    that exposition, so the caller asserts on the very snapshot that showed the counted event.

    This is how a test waits for something a server records once it is done (a request counted in `finally`,
    an ejection, a retry): wait for the count, then assert exact values (`== at_least` catches overshoot).
    """

    async def reached() -> str | None:
        text = await scrape(url)
        return text if metric_value(text, name, **labels) >= at_least else None

    return await wait_for_async(reached, within=within, message=lambda: f"{name}{labels or ''} >= {at_least} at {url}")


def wait_for_metric_sync(url: str, name: str, at_least: float, timeout: float = 30.0, **labels: str) -> str:
    """`wait_for_metric` for synchronous callers (`url` is the base URL; `/metrics` is appended)."""

    def reached() -> str | None:
        text = scrape_sync(url + "/metrics", timeout=5)
        return text if metric_value(text, name, **labels) >= at_least else None

    return wait_for(reached, timeout=timeout, message=lambda: f"{name}{labels or ''} >= {at_least} at {url}")
