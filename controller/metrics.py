"""Prometheus metrics of the controller (``--metrics-port``).

Pool figures (devices and shared capacity per node and kind, pending claims) are computed by
the leader from its snapshot and exported only by the leader, so a dashboard that sums over
replicas does not count the pool twice; followers export them empty. Counters the admission
webhook increments (``WEBHOOK_DECISIONS``, ``WEBHOOK_ERRORS``) are per replica, as every
replica serves the webhook.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from fractions import Fraction
from typing import Any, Final

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from flexgpu.controller.cluster_state import Snapshot
from flexgpu.controller.pending import pending_claims
from flexgpu.driver.allocation import ResourceClaim, ResourceSlice, capacity_summary
from flexgpu.driver.allocation.model import Device
from flexgpu.driver.allocation.summary import current_slices
from flexgpu.driver.names import DRIVER_NAME

WEBHOOK_DECISIONS: Final = Counter(
    "flexgpu_webhook_decisions",
    "Admission decisions of the flexgpu webhook",
    ["kind", "allowed"],  # kind: the object kind reviewed; allowed: "true" or "false"
)
WEBHOOK_ERRORS: Final = Counter(
    "flexgpu_webhook_errors",
    "Admission reviews the webhook could not decide (internal errors)",
    ["kind"],
)
DIAGNOSTIC_EVENTS: Final = Counter(
    "flexgpu_diagnostic_events",
    "GpuClaimUnsatisfiable Events recorded, by the kind of object they are on",
    ["kind"],
)
BINDING_WAIT_EVENTS: Final = Counter(
    "flexgpu_binding_wait_events",
    "GpuBindingConditionPending Events recorded, by the kind of object they are on",
    ["kind"],
)
EXPLAIN_SECONDS: Final = Histogram(
    "flexgpu_explain_duration_seconds",
    "Time to explain one pending claim",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
CLAIM_WAIT_SECONDS: Final = Histogram(
    "flexgpu_claim_pending_duration_seconds",
    "How long pods waited for a claim on a flexgpu class before it was allocated",
    buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 4 * 3600),
)
LEADER: Final = Gauge("flexgpu_controller_leader", "1 while this replica holds the lease")
CLAIM_LABELS_PENDING: Final = Gauge(
    "flexgpu_controller_claim_labels_pending",
    "Allocated claims whose node label the leader has not written yet",
)


def _string(device: Device, name: str) -> str:
    value = device.attributes.get(name)
    return str(value.value) if value is not None and value.kind == "string" else ""


@dataclass(frozen=True)
class DeviceRow:
    node: str
    type: str
    product: str
    profile: str
    total: int
    allocated: int
    free: int


@dataclass(frozen=True)
class SharedRow:
    node: str
    product: str
    resource: str
    granted: Fraction
    free: Fraction


@dataclass(frozen=True)
class PoolFigures:
    devices: tuple[DeviceRow, ...] = ()
    shared: tuple[SharedRow, ...] = ()
    pending: int = 0
    oldest_pending_s: float = 0.0
    unsatisfiable: int = 0
    # binding condition -> claims whose pods wait for it past the grace period
    binding_pending: Mapping[str, int] = field(default_factory=dict)


def _by_pool(
    slices: Iterable[ResourceSlice], claims: Iterable[ResourceClaim]
) -> Iterator[tuple[str, list[ResourceSlice], list[ResourceClaim], set[str]]]:
    """Per pool of ours: its current slices, the claims holding its devices, their names."""
    pools: dict[str, list[ResourceSlice]] = {}
    for s in current_slices(list(slices)):
        if s.driver == DRIVER_NAME:
            pools.setdefault(s.pool, []).append(s)
    holders: dict[str, list[ResourceClaim]] = {}
    taken: dict[str, set[str]] = {}
    for claim in claims:
        for result in claim.allocation or ():
            if result.driver == DRIVER_NAME and result.pool in pools:
                if not holders.get(result.pool) or holders[result.pool][-1] is not claim:
                    holders.setdefault(result.pool, []).append(claim)
                taken.setdefault(result.pool, set()).add(result.device)
    for pool in sorted(pools):
        yield pool, pools[pool], holders.get(pool, []), taken.get(pool, set())


def pool_figures(
    snapshot: Snapshot,
    wall: datetime,
    unsatisfiable: int = 0,
    binding_pending: Mapping[str, int] | None = None,
) -> PoolFigures:
    devices: list[DeviceRow] = []
    shared: list[SharedRow] = []
    claims = [c.model for c in snapshot.claims.values()]
    for pool, slices, holders, taken in _by_pool(snapshot.slices.values(), claims):
        node = slices[0].node_name or pool
        allocated: dict[tuple[str, str, str], int] = {}
        for s in slices:
            for device in s.devices:
                if device.name in taken:
                    kind = (
                        _string(device, "type") or "device",
                        _string(device, "productName"),
                        _string(device, "profile"),
                    )
                    allocated[kind] = allocated.get(kind, 0) + 1
        for row in capacity_summary(slices, holders):
            kind = (row.type, row.product, row.profile)
            devices.append(DeviceRow(node, *kind, row.total, allocated.get(kind, 0), row.free))
            for resource, (left, total) in row.shareable.items():
                shared.append(SharedRow(node, row.product, resource, total - left, left))
    waits = [p.waiting_s for p in pending_claims(snapshot, wall, 0.0)]
    return PoolFigures(
        devices=tuple(devices),
        shared=tuple(shared),
        pending=len(waits),
        oldest_pending_s=max(waits, default=0.0),
        unsatisfiable=unsatisfiable,
        binding_pending=dict(binding_pending or {}),
    )


@dataclass
class PendingClock:
    """Observes ``CLAIM_WAIT_SECONDS`` when a claim that pods waited for gets allocated."""

    waiting: dict[str, datetime] = field(default_factory=dict)  # claim key -> pod created

    def update(self, snapshot: Snapshot, wall: datetime) -> None:
        now_waiting: dict[str, datetime] = {}
        for item in pending_claims(snapshot, wall, 0.0):
            created = item.pod.created
            if created is not None:
                key = item.claim.model.key
                now_waiting[key] = min(created, now_waiting.get(key, created))
        for key, since in self.waiting.items():
            claim = snapshot.claims.get(key)
            if key not in now_waiting and claim is not None and claim.allocated:
                CLAIM_WAIT_SECONDS.observe(max((wall - since).total_seconds(), 0.0))
        self.waiting = now_waiting


class PoolCollector(Collector):
    """Exports the latest ``PoolFigures``; labels of nodes that left vanish with them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._figures: PoolFigures | None = None

    def update(self, figures: PoolFigures | None) -> None:
        with self._lock:
            self._figures = figures

    def collect(self) -> Iterator[Any]:
        with self._lock:
            figures = self._figures
        labels = ["node", "type", "product", "profile"]
        families: Mapping[str, GaugeMetricFamily] = {
            name: GaugeMetricFamily(f"flexgpu_devices_{name}", text, labels=labels)
            for name, text in (
                ("published", "Devices flexgpu publishes"),
                ("allocated", "Devices allocated to claims"),
                ("free", "Devices that can be allocated now"),
            )
        }
        # One unit per family: memory in bytes, compute in GPUs (a share of 50 % is 0.5).
        shared = {
            "memory": (
                GaugeMetricFamily(
                    "flexgpu_shared_memory_bytes",
                    "Memory of shared GPUs, granted to claims or free",
                    labels=["node", "product", "state"],
                ),
                Fraction(1),
            ),
            "compute": (
                GaugeMetricFamily(
                    "flexgpu_shared_compute_gpus",
                    "Compute of shared GPUs in whole GPUs (1 = one GPU), granted or free",
                    labels=["node", "product", "state"],
                ),
                Fraction(1, 100),  # published as percent of one GPU
            ),
        }
        pending = GaugeMetricFamily(
            "flexgpu_claims_pending", "Claims on flexgpu classes pods wait for"
        )
        oldest = GaugeMetricFamily(
            "flexgpu_claims_pending_oldest_seconds", "How long the longest-waiting pod has waited"
        )
        unsatisfiable = GaugeMetricFamily(
            "flexgpu_claims_unsatisfiable",
            "Pending claims the evaluator finds no place for (past the diagnostics delay)",
        )
        binding = GaugeMetricFamily(
            "flexgpu_claims_binding_pending",
            "Allocated claims whose pods wait past the grace period for a flexgpu binding "
            "condition (the node's kubelet plugin has not set it), by condition",
            labels=["condition"],
        )
        if figures is not None:
            for condition, count in sorted(figures.binding_pending.items()):
                binding.add_metric([condition], count)
            for row in figures.devices:
                values = [row.node, row.type, row.product, row.profile]
                families["published"].add_metric(values, row.total)
                families["allocated"].add_metric(values, row.allocated)
                families["free"].add_metric(values, row.free)
            for s in figures.shared:
                if s.resource not in shared:
                    continue  # a capacity without a family of its own is not exported
                family, scale = shared[s.resource]
                family.add_metric([s.node, s.product, "granted"], float(s.granted * scale))
                family.add_metric([s.node, s.product, "free"], float(s.free * scale))
            pending.add_metric([], figures.pending)
            oldest.add_metric([], figures.oldest_pending_s)
            unsatisfiable.add_metric([], figures.unsatisfiable)
        yield from families.values()
        yield from (family for family, _ in shared.values())
        yield from (pending, oldest, unsatisfiable, binding)


POOL: Final = PoolCollector()
REGISTRY.register(POOL)


def serve(port: int, address: str = "0.0.0.0") -> None:
    """Starts the /metrics endpoint in a daemon thread."""
    start_http_server(port, address)
