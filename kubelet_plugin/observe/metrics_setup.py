"""Starts the plugin's metrics: settings from the environment (the chart sets them), the
usage sampler, the collectors and the /metrics endpoint.

    FLEXGPU_METRICS_PORT     port of /metrics; unset, empty or 0: no endpoint, no sampling
    FLEXGPU_METRICS_ADDRESS  address to listen on (default 0.0.0.0)
    FLEXGPU_USAGE_INTERVAL   seconds between usage samples (default 15)
    FLEXGPU_IDLE_THRESHOLD   SM utilisation (0-1) below which a claim's device is idle (0.05)
    FLEXGPU_IDLE_WINDOW      how long a claim must stay idle to count as idle, a Prometheus
                             duration such as 90s, 30m or 2h (default 2h)
    FLEXGPU_PROC_ROOT        where process cgroups are read (default /proc)
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from flexgpu.driver.backend import GpuBackend
from flexgpu.kubelet_plugin.api.kube_api import KubeApi, path_of
from flexgpu.kubelet_plugin.claims.checkpoint_records import ClaimRecord
from flexgpu.kubelet_plugin.claims.claim_objects import ClaimObjects
from flexgpu.kubelet_plugin.claims.driver_change import DriverChange
from flexgpu.kubelet_plugin.claims.preparer import ClaimPreparerImpl
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices
from flexgpu.kubelet_plugin.devices.slice_publisher import SlicePublisher
from flexgpu.kubelet_plugin.observe import metrics
from flexgpu.kubelet_plugin.observe.metrics_settings import (
    MetricsSettingError,
    MetricsSettings,
    settings_from_env,
)
from flexgpu.kubelet_plugin.observe.usage import UsageSampler
from flexgpu.kubelet_plugin.observe.usage_metrics import UsageCollector

__all__ = ["MetricsSettingError", "MetricsSettings", "observe_node", "settings_from_env"]

log = logging.getLogger(__name__)

# A prepared claim is read again at most this often: pods may join a shared claim later.
CLAIM_REREAD_S = 300.0
CLAIM_RETRY_S = 30.0


class ClaimReader:
    """The claim object for a record: the plugin's cached copy, else a GET (at most once per
    ``CLAIM_REREAD_S`` per claim); None when neither has it."""

    def __init__(
        self,
        cached: Callable[[str], Mapping[str, Any] | None],
        read: Callable[[str, str], Mapping[str, Any] | None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cached = cached
        self._read = read
        self._clock = clock
        self._lock = threading.Lock()
        self._read_at: dict[str, tuple[float, Mapping[str, Any] | None]] = {}

    def __call__(self, record: ClaimRecord) -> Mapping[str, Any] | None:
        with self._lock:
            earlier = self._read_at.get(record.uid)
        now = self._clock()
        if earlier is not None and now - earlier[0] < CLAIM_REREAD_S:
            return earlier[1]
        obj = self._cached(record.uid)
        if obj is None or earlier is not None:
            try:
                read = self._read(record.namespace, record.name)
            except Exception as err:  # pods unknown for now; figures still count
                log.debug("cannot read claim %s/%s: %s", record.namespace, record.name, err)
                read = None
            uid = ((read or {}).get("metadata") or {}).get("uid")
            obj = read if uid == record.uid else obj
        # Nothing found: try again sooner than a claim that was read.
        stamp = now if obj is not None else now - CLAIM_REREAD_S + CLAIM_RETRY_S
        with self._lock:
            self._read_at[record.uid] = (stamp, obj)
            if len(self._read_at) > 1024:  # forget claims no longer asked about
                self._read_at = {
                    k: v for k, v in self._read_at.items() if now - v[0] < 2 * CLAIM_REREAD_S
                }
        return obj


def observe_node(
    settings: MetricsSettings,
    *,
    node_name: str,
    backend: GpuBackend,
    devices: NodeDevices,
    preparer: ClaimPreparerImpl,
    objects: ClaimObjects,
    api: KubeApi,
    publisher: SlicePublisher,
    status_refusals: Callable[[], int] | None = None,
    driver_change: DriverChange | None = None,
) -> Callable[[], None]:
    """Registers the node's collectors, starts sampling and the endpoint; returns the stop.
    Without a port nothing starts (and nothing is sampled)."""
    if settings.port is None:
        return lambda: None

    def read_claim(namespace: str, name: str) -> Mapping[str, Any]:
        path = path_of("apis", "resource.k8s.io", "v1", "namespaces", namespace)
        return api.get(f"{path}/resourceclaims/{name}")

    sampler = UsageSampler(
        node_name,
        backend,
        devices=devices,
        records=lambda: preparer.load_checkpoint().claims.values(),  # noqa: PLW0108 - fresh each sample
        claim_object=ClaimReader(objects.get, read_claim),
        settings=settings.usage,
    )
    metrics.register(
        "node",
        metrics.NodeCollector(
            metrics.NodeSources(
                node_name,
                gpu_health=lambda: [g.health for g in devices.gpus()],
                slice_counts=lambda: (publisher.reconciles, publisher.failures),
                status_refusals=status_refusals,
            )
        ),
    )
    metrics.register("usage", UsageCollector(sampler))
    if driver_change is not None:
        driver_change.on_settled = functools.partial(metrics.driver_settled, node_name)
    sampler.start()
    server = metrics.MetricsServer(settings.port, settings.address)
    log.info(
        "metrics on %s:%d, usage sampled every %gs",
        settings.address,
        server.port,
        settings.usage.interval_s,
    )

    def stop() -> None:
        server.stop()
        sampler.stop()

    return stop
