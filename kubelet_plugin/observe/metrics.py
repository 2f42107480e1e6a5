"""Prometheus metrics of the kubelet plugin, served on ``FLEXGPU_METRICS_PORT`` (the chart
sets it; unset or 0: no endpoint).

Operations: prepare/unprepare latency and errors by reason, slice publishes and failures,
health events and Xids, MIG instances created and destroyed, MPS daemons. Usage: per GPU and
per prepared claim (``kubelet_plugin/observe/usage.py``). Every series carries the ``node``
label, so figures read straight from a plugin, or through a Prometheus that does not relabel,
still say where they come from. The plugin keeps its own registry: the process figures it adds
(``process_resident_memory_bytes``...) are the plugin's alone.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from flexgpu.driver.gpu_model import HealthEvent, HealthState
from flexgpu.kubelet_plugin.claims.pipeline import Call, R, Step
from flexgpu.kubelet_plugin.kubeletplugin import ClaimRef

log = logging.getLogger(__name__)

REGISTRY: Final = CollectorRegistry()
ProcessCollector(registry=REGISTRY)

_LATENCY_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
PREPARE_SECONDS: Final = Histogram(
    "flexgpu_plugin_prepare_duration_seconds",
    "Time to answer one NodePrepareResources call (every claim of a pod)",
    ["node"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
UNPREPARE_SECONDS: Final = Histogram(
    "flexgpu_plugin_unprepare_duration_seconds",
    "Time to answer one NodeUnprepareResources call",
    ["node"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
PREPARE_ERRORS: Final = Counter(
    "flexgpu_plugin_prepare_errors",
    "Claims whose prepare failed, by reason",
    ["node", "reason"],
    registry=REGISTRY,
)
UNPREPARE_ERRORS: Final = Counter(
    "flexgpu_plugin_unprepare_errors",
    "Claims whose unprepare failed, by reason",
    ["node", "reason"],
    registry=REGISTRY,
)
HEALTH_EVENTS: Final = Counter(
    "flexgpu_plugin_health_events",
    "Health events from the GPUs: kind Xid (with its number) or GPULost",
    ["node", "kind", "xid"],
    registry=REGISTRY,
)
MIG_OPERATIONS: Final = Counter(
    "flexgpu_plugin_mig_operations",
    "MIG instances created and destroyed, by profile and result (ok or error)",
    ["node", "operation", "profile", "result"],
    registry=REGISTRY,
)
MPS_OPERATIONS: Final = Counter(
    "flexgpu_plugin_mps_daemon_operations",
    "MPS control daemons started and stopped, by result (ok or error)",
    ["node", "operation", "result"],
    registry=REGISTRY,
)

# The reasons a prepare or unprepare error is counted under, from the text the kubelet gets
# (the preparer reports text only). First match wins; anything else is "other".
ERROR_REASONS: Final[tuple[tuple[str, re.Pattern[str]], ...]] = (
    ("starting", re.compile(r"still starting|failed to start")),
    ("claim_not_found", re.compile(r" not found\b|deleted and re-created")),
    ("not_allocated", re.compile(r"is not allocated|not published by node|out of date")),
    (
        "conflict",
        re.compile(r"changed meanwhile|already prepared for|would take|another namespace"),
    ),
    ("config", re.compile(r"sharing|config|MPS sharing|strategy|not supported on", re.I)),
    ("mig", re.compile(r"\bMIG\b")),
    ("mps", re.compile(r"\bMPS\b")),
    ("node_state", re.compile(r"checkpoint|No space|errno|Errno|CDI spec")),
    ("gpu", re.compile(r"\bGPU\b|NVML")),
)


def error_reason(error: str) -> str:
    for reason, pattern in ERROR_REASONS:
        if pattern.search(error):
            return reason
    return "other"


def mig_operation(node: str, operation: str, profile: str, result: str) -> None:
    MIG_OPERATIONS.labels(node, operation, profile, result).inc()


def mps_operation(node: str, operation: str, result: str) -> None:
    MPS_OPERATIONS.labels(node, operation, result).inc()


def health_event(node: str, event: HealthEvent) -> None:
    HEALTH_EVENTS.labels(node, str(event.kind), "" if event.xid is None else str(event.xid)).inc()


class CallMetrics:
    """The pipeline stage that times each call and counts its failed claims by reason."""

    name = "metrics"

    def __init__(self, node_name: str) -> None:
        self._node = node_name
        # Series exist from the start (count 0), so rates read 0 rather than nothing.
        PREPARE_SECONDS.labels(node_name)
        UNPREPARE_SECONDS.labels(node_name)

    def around(
        self, call: Call[R], claims: Sequence[ClaimRef], next_step: Step[R]
    ) -> Mapping[str, R]:
        seconds, errors = _CALL_SERIES[call.name]
        start = time.perf_counter()
        try:
            results = next_step(claims)
        except Exception as err:
            errors.labels(self._node, error_reason(str(err))).inc(len(claims))
            raise
        finally:
            seconds.labels(self._node).observe(time.perf_counter() - start)
        for result in results.values():
            if result.error:
                errors.labels(self._node, error_reason(result.error)).inc()
        return results


# Each call's latency histogram and error counter, by the call's name.
_CALL_SERIES: Final[dict[str, tuple[Histogram, Counter]]] = {
    "prepare": (PREPARE_SECONDS, PREPARE_ERRORS),
    "unprepare": (UNPREPARE_SECONDS, UNPREPARE_ERRORS),
}


@dataclass
class NodeSources:
    """Where the node-level figures are read at scrape time; each may be missing."""

    node: str
    gpu_health: Callable[[], Sequence[HealthState]] | None = None
    slice_counts: Callable[[], tuple[int, int]] | None = None  # (publishes, failures)
    # Claim status writes the API server refused even as built from a fresh read.
    status_refusals: Callable[[], int] | None = None


class NodeCollector(Collector):
    """GPUs by health and slice publishing, read when Prometheus scrapes."""

    def __init__(self, sources: NodeSources) -> None:
        self.sources = sources

    def collect(self) -> Iterator[Any]:
        node = self.sources.node
        gpus = GaugeMetricFamily(
            "flexgpu_plugin_gpus", "GPUs the plugin found, by health", labels=["node", "health"]
        )
        if self.sources.gpu_health is not None:
            states = list(self.sources.gpu_health())
            healthy = sum(1 for s in states if s == HealthState.HEALTHY)
            gpus.add_metric([node, "healthy"], healthy)
            gpus.add_metric([node, "unhealthy"], len(states) - healthy)
        yield gpus
        publishes = CounterMetricFamily(
            "flexgpu_plugin_slice_publishes",
            "Reconcile passes that wrote the node's ResourceSlices",
            labels=["node"],
        )
        failures = CounterMetricFamily(
            "flexgpu_plugin_slice_publish_failures",
            "Reconcile passes of the node's ResourceSlices that failed (retried)",
            labels=["node"],
        )
        if self.sources.slice_counts is not None:
            wrote, failed = self.sources.slice_counts()
            publishes.add_metric([node], wrote)
            failures.add_metric([node], failed)
        yield publishes
        yield failures
        refused = CounterMetricFamily(
            "flexgpu_plugin_claim_status_refused",
            "Claim status writes the API server refused even as built from a fresh read "
            "(the plugin's log names the claim and the server's reason)",
            labels=["node"],
        )
        if self.sources.status_refusals is not None:
            refused.add_metric([node], self.sources.status_refusals())
        yield refused


class MetricsServer:
    """The /metrics endpoint in a daemon thread; ``port`` is the bound one (0 asks the OS)."""

    def __init__(self, port: int, address: str = "0.0.0.0") -> None:
        self._server, self._thread = start_http_server(port, address, registry=REGISTRY)
        self.port = int(self._server.server_port)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


_registered: dict[str, Collector] = {}
_registered_lock = threading.Lock()


def register(name: str, collector: Collector) -> None:
    """Registers ``collector`` under ``name``, replacing an earlier one of that name (a test
    that starts the node twice in one process)."""
    with _registered_lock:
        old = _registered.pop(name, None)
        if old is not None:
            REGISTRY.unregister(old)
        REGISTRY.register(collector)
        _registered[name] = collector
