"""Reads the kubelet plugins' /metrics endpoints directly, for `flexgpu usage` without a
Prometheus and for the controller's idle-claim Events.

An endpoint is ``host:port`` or a URL. A host name stands for every address it resolves to:
the chart's headless ``<release>-kubelet-plugin-metrics`` Service resolves to each plugin
pod, so one name reaches every node. An endpoint that does not answer is reported and left
out; the others still count.
"""

from __future__ import annotations

import logging
import socket
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


@dataclass
class Scrape:
    samples: list[Sample] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # "url: why"

    def named(self, name: str) -> Iterator[Sample]:
        return (s for s in self.samples if s.name == name)


def endpoint_urls(endpoints: Iterable[str]) -> list[str]:
    """Every /metrics URL the endpoints stand for (names resolved to all their addresses)."""
    urls: list[str] = []
    for endpoint in endpoints:
        text = endpoint.strip()
        if not text:
            continue
        url = text if "://" in text else f"http://{text}"
        parts = urlsplit(url)
        path = parts.path if parts.path not in ("", "/") else "/metrics"
        host, port = parts.hostname or "", parts.port
        if port is None:
            raise ValueError(
                f"plugin metrics endpoint {endpoint!r} has no port; allowed: host:port or "
                "http://host:port/metrics"
            )
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            addresses = sorted({str(info[4][0]) for info in infos})
        except OSError:
            addresses = [host]  # reported as a failure when fetched
        for address in addresses:
            shown = f"[{address}]" if ":" in address else address
            urls.append(f"{parts.scheme}://{shown}:{port}{path}")
    return urls


def parse(text: str) -> list[Sample]:
    samples = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.append(Sample(s.name, dict(s.labels), float(s.value)))
    return samples


def scrape(endpoints: Sequence[str], timeout_s: float = TIMEOUT_S) -> Scrape:
    result = Scrape()
    for url in endpoint_urls(endpoints):
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as response:
                text = response.read().decode()
            result.samples.extend(parse(text))
        except (OSError, ValueError) as err:
            log.warning("cannot read plugin metrics %s: %s", url, err)
            result.failures.append(f"{url}: {err}")
    return result
