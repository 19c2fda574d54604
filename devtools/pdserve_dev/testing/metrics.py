"""Reading Prometheus text expositions in tests, benchmarks and the demo: one parser for all of them.

It goes through prometheus_client's public parser only (never a registry's private attributes), so what a test
reads is exactly what Prometheus would scrape.
"""

from __future__ import annotations

import urllib.request

import aiohttp
from prometheus_client.parser import text_string_to_metric_families


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
