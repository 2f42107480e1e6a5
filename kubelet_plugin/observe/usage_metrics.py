"""The usage sampler's figures as Prometheus metrics: per GPU, per claim device, and each
claim's GPU-seconds allocated and used and idle time."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from flexgpu.kubelet_plugin.observe.usage import UsageSampler
from flexgpu.kubelet_plugin.observe.usage_model import DeviceUsage

CLAIM_LABELS = (
    "node",
    "namespace",
    "claim",
    "device",
    "class",
    "product",
    "profile",
    "share",
    "pods",
)


def _claim_labels(node: str, d: DeviceUsage) -> list[str]:
    return [
        node,
        d.namespace,
        d.claim,
        d.device,
        d.device_class,
        d.product,
        d.profile,
        d.share,
        ",".join(d.pods),
    ]


class UsageCollector(Collector):
    """Exports the sampler's latest snapshot and running totals."""

    def __init__(self, sampler: UsageSampler) -> None:
        self.sampler = sampler

    def collect(self) -> Iterator[Any]:
        snap = self.sampler.snapshot
        totals = self.sampler.totals()
        node = snap.node
        gpu_labels = ["node", "device", "product", "claims"]
        gpu_util = GaugeMetricFamily(
            "flexgpu_gpu_sm_utilization_ratio", "SM utilisation of the GPU (0-1)", labels=gpu_labels
        )
        gpu_mem = GaugeMetricFamily(
            "flexgpu_gpu_memory_used_bytes", "GPU memory in use", labels=gpu_labels
        )
        gpu_total = GaugeMetricFamily(
            "flexgpu_gpu_memory_total_bytes", "GPU memory", labels=gpu_labels
        )
        gpu_procs = GaugeMetricFamily(
            "flexgpu_gpu_processes", "Processes running on the GPU", labels=gpu_labels
        )
        for row in snap.gpus:
            values = [node, row.device, row.product, ",".join(row.claims)]
            if row.sm_utilization is not None:
                gpu_util.add_metric(values, row.sm_utilization)
            if row.memory_used_bytes is not None:
                gpu_mem.add_metric(values, row.memory_used_bytes)
            gpu_total.add_metric(values, row.memory_total_bytes)
            gpu_procs.add_metric(values, row.processes)
        yield from (gpu_util, gpu_mem, gpu_total, gpu_procs)

        labels = list(CLAIM_LABELS)
        allocated = GaugeMetricFamily(
            "flexgpu_claim_allocated_gpus",
            "Part of a GPU a claim's device is (1 whole, a MIG instance's SMs, a share's compute)",
            labels=labels,
        )
        util = GaugeMetricFamily(
            "flexgpu_claim_sm_utilization_ratio",
            "SM utilisation of a claim's device (0-1; a share: of the whole GPU, by its processes)",
            labels=labels,
        )
        used = GaugeMetricFamily(
            "flexgpu_claim_used_gpus",
            "Busy GPUs of a claim's device (utilisation x part)",
            labels=labels,
        )
        memory = GaugeMetricFamily(
            "flexgpu_claim_memory_used_bytes", "Memory a claim's device has in use", labels=labels
        )
        processes = GaugeMetricFamily(
            "flexgpu_claim_processes", "Processes on a claim's device", labels=labels
        )
        allocated_s = CounterMetricFamily(
            "flexgpu_claim_allocated_gpu_seconds",
            "GPU-seconds held by a claim's device since it was prepared (or the plugin started)",
            labels=labels,
        )
        used_s = CounterMetricFamily(
            "flexgpu_claim_used_gpu_seconds",
            "GPU-seconds a claim's device was busy since it was prepared (or the plugin started)",
            labels=labels,
        )
        for d in snap.devices:
            values = _claim_labels(node, d)
            allocated.add_metric(values, d.allocated_gpus)
            if d.sm_utilization is not None:
                util.add_metric(values, d.sm_utilization)
            if d.used_gpus is not None:
                used.add_metric(values, d.used_gpus)
            if d.memory_used_bytes is not None:
                memory.add_metric(values, d.memory_used_bytes)
            if d.processes is not None:
                processes.add_metric(values, d.processes)
            t = totals.get(d.uid)
            if t is not None:
                allocated_s.add_metric(values, t.allocated_gpu_seconds.get(d.device, 0.0))
                used_s.add_metric(values, t.used_gpu_seconds.get(d.device, 0.0))
        yield from (allocated, util, used, memory, processes, allocated_s, used_s)

        idle = GaugeMetricFamily(
            "flexgpu_claim_idle_seconds",
            "How long every device of the claim has been below the idle threshold (0: busy)",
            labels=["node", "namespace", "claim", "pods"],
        )
        pods = {d.uid: ",".join(d.pods) for d in snap.devices}
        for uid, seconds in snap.idle_seconds.items():
            t = totals.get(uid)
            if t is not None and uid in pods:
                idle.add_metric([node, t.namespace, t.claim, pods[uid]], seconds or 0.0)
        yield idle
        mps = GaugeMetricFamily(
            "flexgpu_plugin_mps_daemons", "MPS control daemons running", labels=["node"]
        )
        if snap.mps_daemons is not None:
            mps.add_metric([node], snap.mps_daemons)
        yield mps
