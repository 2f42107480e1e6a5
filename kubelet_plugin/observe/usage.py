"""GPU usage per device and per prepared claim, sampled from the backend every interval.

For each claim this node prepared (the checkpoint's Prepared records) and each of its devices:
SM utilisation, memory in use and processes, labelled with the claim, the pods it is reserved
for (from the claim object the plugin read for prepare or status), the device, its class and
its MIG profile or share. How each kind is measured:

- whole GPU: NVML's device figures;
- MIG instance: memory and processes of the instance; SM utilisation from its processes'
  samples (NVML has no device figure for an instance), 0 when no process runs there;
- share of a shared GPU: the processes of the pods the claim is reserved for (process ->
  pod by cgroup, ``pod_cgroup.py``). When any process on the GPU belongs to no share's pod,
  the shares get no figures of their own: the GPU's row lists them instead.

Fractions of a GPU: a MIG instance holds its share of the GPU's multiprocessors, a share its
compute percentage (or, with none, its part of the memory). From those the sampler adds up
GPU-seconds allocated and used per claim device, and how long each claim has been idle:
every device below the threshold; a device without a figure makes the claim's state unknown.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

from flexgpu.driver.backend import GpuBackend
from flexgpu.driver.backoff import Backoff
from flexgpu.driver.gpu_model import GpuInfo, MigProfile, ProcessSample
from flexgpu.driver.loop import Loop
from flexgpu.driver.names import mig_device_name
from flexgpu.driver.quantity import QuantityError, parse_quantity
from flexgpu.driver.usage import GpuUsage, summed_memory, summed_utilization
from flexgpu.kubelet_plugin.claims.checkpoint_records import ClaimRecord, ClaimState, DeviceRecord
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices
from flexgpu.kubelet_plugin.observe.pod_cgroup import pod_uid_of
from flexgpu.kubelet_plugin.observe.usage_model import (
    ClaimInfo,
    ClaimTotals,
    DeviceUsage,
    GpuRow,
    UsageSettings,
    UsageSnapshot,
    claim_info,
)

log = logging.getLogger(__name__)

_MIB = 1024 * 1024
RETRY_CAP_S = (
    60.0  # longest delay between retries of failing samples (unless the interval is longer)
)
_PARENT = re.compile(r"gpu-(\d+)(-mig-|$)")
_MIG_NAME = re.compile(r"gpu-\d+-mig-")
CLASS_OF_KIND = {
    "gpu": "gpu.flexgpu.dev",
    "mig": "mig.flexgpu.dev",
    "shared": "shared-gpu.flexgpu.dev",
}


def _ratio(percent: int | None) -> float | None:
    return None if percent is None else percent / 100


def _bytes(mib: int | None) -> int | None:
    return None if mib is None else mib * _MIB


def _share_fraction(record: DeviceRecord, gpu: GpuInfo) -> float:
    try:
        compute = parse_quantity(record.consumed_capacity.get("compute", "0")).value
        memory = parse_quantity(record.consumed_capacity.get("memory", "0")).value
    except QuantityError:
        return 0.0
    if compute > 0:
        return float(compute) / 100
    total = gpu.memory_mib * _MIB
    return float(memory) / total if total else 0.0


class UsageSampler:
    """Samples usage in a thread; ``snapshot`` is the latest sample."""

    def __init__(
        self,
        node_name: str,
        backend: GpuBackend,
        *,
        devices: NodeDevices,
        records: Callable[[], Iterable[ClaimRecord]],
        claim_object: Callable[[ClaimRecord], Mapping[str, Any] | None],
        settings: UsageSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node = node_name
        self.settings = settings or UsageSettings()
        self._backend = backend
        self._devices = devices
        self._records = records
        self._claim_object = claim_object
        self._clock = clock
        self._lock = threading.Lock()
        self._snapshot = UsageSnapshot(node_name)
        self._totals: dict[str, ClaimTotals] = {}
        self._profiles: dict[int, dict[int, MigProfile]] = {}
        self._last: float | None = None
        # A sample at start, then one per interval; a failed sample (NVML hiccup) is logged
        # and retried after a jittered delay growing from one interval to a minute at most.
        interval_s = self.settings.interval_s
        self._loop = Loop(
            "usage",
            self._sample_step,
            interval_s,
            backoff=Backoff(interval_s, max(interval_s, RETRY_CAP_S)),
        )

    # -- thread --------------------------------------------------------------------------
    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop(timeout_s=5)

    @property
    def running(self) -> bool:
        return self._loop.running

    @property
    def last_error(self) -> str | None:
        """Why the last sample failed; None after one that worked."""
        return self._loop.last_error

    def _sample_step(self) -> None:
        self.sample_once()  # its snapshot is not returned: Loop would read it as the next wait

    @property
    def snapshot(self) -> UsageSnapshot:
        with self._lock:
            return self._snapshot

    def totals(self) -> dict[str, ClaimTotals]:
        with self._lock:
            return {uid: replace(t) for uid, t in self._totals.items()}

    # -- one sample ----------------------------------------------------------------------
    def sample_once(self) -> UsageSnapshot:
        now = self._clock()
        gpus = {g.index: g for g in self._devices.gpus()}
        usage: dict[int, GpuUsage] = {}
        for index in sorted(gpus):
            try:
                usage[index] = self._backend.gpu_usage(index)
            except Exception as err:  # a lost GPU has no usage; the others still count
                log.debug("no usage of GPU %d: %s", index, err)
        prepared = [r for r in self._records() if r.state == ClaimState.PREPARED]
        devices = list(self._claim_devices(prepared, gpus, usage))
        rows = self._gpu_rows(gpus, usage, devices)
        try:
            mps: int | None = len(self._backend.mps_daemons())
        except Exception:
            mps = None
        with self._lock:
            elapsed = 0.0 if self._last is None else now - self._last
            # A gap (stopped process, slow sample) is not counted as allocated or used time.
            elapsed = min(max(elapsed, 0.0), 2 * self.settings.interval_s)
            self._last = now
            idle = self._account(prepared, devices, now, elapsed)
            self._snapshot = UsageSnapshot(self.node, rows, tuple(devices), idle, mps)
            return self._snapshot

    def _account(
        self, prepared: Sequence[ClaimRecord], devices: Sequence[DeviceUsage], now: float, dt: float
    ) -> dict[str, float | None]:
        live = {r.uid for r in prepared}
        for uid in list(self._totals):
            if uid not in live:
                del self._totals[uid]  # unprepared: its series go with it
        by_claim: dict[str, list[DeviceUsage]] = {}
        for d in devices:
            by_claim.setdefault(d.uid, []).append(d)
        idle: dict[str, float | None] = {}
        for record in prepared:
            totals = self._totals.setdefault(record.uid, ClaimTotals(record.namespace, record.name))
            mine = by_claim.get(record.uid, [])
            for d in mine:
                totals.allocated_gpu_seconds[d.device] = (
                    totals.allocated_gpu_seconds.get(d.device, 0.0) + d.allocated_gpus * dt
                )
                used = d.used_gpus
                if used is not None:
                    totals.used_gpu_seconds[d.device] = (
                        totals.used_gpu_seconds.get(d.device, 0.0) + used * dt
                    )
            below = bool(mine) and all(
                d.sm_utilization is not None and d.sm_utilization < self.settings.idle_threshold
                for d in mine
            )
            if not below:
                totals.idle_since = None
            elif totals.idle_since is None:
                totals.idle_since = now
            idle[record.uid] = None if totals.idle_since is None else now - totals.idle_since
        return idle

    def _claim_devices(
        self,
        prepared: Sequence[ClaimRecord],
        gpus: Mapping[int, GpuInfo],
        usage: Mapping[int, GpuUsage],
    ) -> Iterator[DeviceUsage]:
        infos = {r.uid: claim_info(self._claim_object(r)) for r in prepared}
        # Per shared GPU, its shares; per pod UID the claims it may use.
        shares: dict[int, list[tuple[ClaimRecord, DeviceRecord]]] = {}
        for record in prepared:
            for device in record.devices:
                if device.pool_name == self.node and device.share_id:
                    gpu = self._devices.gpu(device.device_name)
                    if gpu is not None:
                        shares.setdefault(gpu.index, []).append((record, device))
        attributed = {
            index: self._attribute(usage[index].processes, shares[index], infos)
            for index in shares
            if index in usage
        }
        for record in prepared:
            info = infos[record.uid]
            for device in record.devices:
                if device.pool_name != self.node:
                    continue
                gpu = self._gpu_of(device.device_name, gpus)
                if gpu is None:
                    continue
                gpu_usage = usage.get(gpu.index)
                yield self._device_usage(record, device, gpu, gpu_usage, info, attributed)

    def _device_usage(  # noqa: PLR0917 - one call site, every argument distinct
        self,
        record: ClaimRecord,
        device: DeviceRecord,
        gpu: GpuInfo,
        usage: GpuUsage | None,
        info: ClaimInfo,
        attributed: Mapping[int, Mapping[str, list[ProcessSample]] | None],
    ) -> DeviceUsage:
        kind = "shared" if device.share_id else self._devices.device_type(device.device_name)
        if _MIG_NAME.match(device.device_name):
            kind = "mig"
        profile = ""
        fraction = 1.0
        util: float | None = None
        memory: int | None = None
        processes: int | None = None
        if kind == "mig":
            instance = self._mig_instance(gpu.index, device.device_name)
            if instance is not None:
                profile = instance[1]
                fraction = instance[2] / gpu.multiprocessors if gpu.multiprocessors else 0.0
                mig = next(
                    (m for m in (usage.mig if usage else ()) if m.gpu_instance_id == instance[0]),
                    None,
                )
                if mig is not None:
                    util = _ratio(mig.sm_utilization_percent)
                    memory = _bytes(mig.memory_used_mib)
                    processes = len(mig.processes)
        elif kind == "shared":
            fraction = _share_fraction(device, gpu)
            split = attributed.get(gpu.index)
            if split is not None:
                mine = split.get(record.uid, [])
                util = _ratio(summed_utilization(mine))
                memory = _bytes(summed_memory(mine))
                processes = len(mine)
        elif usage is not None:
            util = _ratio(usage.sm_utilization_percent)
            memory = _bytes(usage.memory_used_mib)
            processes = len(usage.processes)
        names = device.request_names or list(info.classes)
        device_class = next(
            (info.classes[n] for n in names if n in info.classes), CLASS_OF_KIND.get(kind, "")
        )
        return DeviceUsage(
            namespace=record.namespace,
            claim=record.name,
            uid=record.uid,
            device=device.device_name,
            gpu_index=gpu.index,
            kind=kind,
            device_class=device_class,
            product=gpu.product_name,
            profile=profile,
            share=device.share_id or "",
            pods=info.users,
            allocated_gpus=fraction,
            sm_utilization=util,
            memory_used_bytes=memory,
            processes=processes,
        )

    def _gpu_of(self, device_name: str, gpus: Mapping[int, GpuInfo]) -> GpuInfo | None:
        """The GPU behind a device name; by its index in the name when the device is no
        longer published (the GPU's mode changed while the claim still holds it)."""
        gpu = self._devices.gpu(device_name)
        if gpu is None:
            match = _PARENT.match(device_name)
            gpu = gpus.get(int(match.group(1))) if match else None
        return gpu

    def _mig_instance(self, index: int, device_name: str) -> tuple[int, str, int] | None:
        """(GPU instance id, profile name, multiprocessors) of the MIG device by its name."""
        try:
            instances = self._backend.list_mig_devices(index)
            if index not in self._profiles:  # fixed per GPU model; NVML takes a while
                self._profiles[index] = {p.profile_id: p for p in self._backend.mig_profiles(index)}
            profiles = self._profiles[index]
        except Exception:
            return None
        for m in instances:
            if mig_device_name(index, m.profile_name, m.placement.start) == device_name:
                profile = profiles.get(m.profile_id)
                return m.gpu_instance_id, m.profile_name, profile.multiprocessors if profile else 0
        return None

    def _attribute(
        self,
        processes: Sequence[ProcessSample],
        shares: Sequence[tuple[ClaimRecord, DeviceRecord]],
        infos: Mapping[str, ClaimInfo],
    ) -> dict[str, list[ProcessSample]] | None:
        """Processes of a shared GPU by the claim whose pods run them; None when any process
        belongs to no pod of exactly one share (then only the GPU has figures). A PodGroup's
        claim names no pods, so a GPU shared with one has GPU figures only."""
        claims_of_pod: dict[str, set[str]] = {}
        for record, _ in shares:
            for pod in infos[record.uid].pods:
                claims_of_pod.setdefault(pod.uid, set()).add(record.uid)
        split: dict[str, list[ProcessSample]] = {record.uid: [] for record, _ in shares}
        for process in processes:
            pod_uid = pod_uid_of(process.pid, self.settings.proc_root)
            owners = claims_of_pod.get(pod_uid or "", set())
            if len(owners) != 1:
                return None
            split[next(iter(owners))].append(process)
        return split

    def _gpu_rows(
        self,
        gpus: Mapping[int, GpuInfo],
        usage: Mapping[int, GpuUsage],
        devices: Sequence[DeviceUsage],
    ) -> tuple[GpuRow, ...]:
        holders: dict[int, set[str]] = {}
        for d in devices:
            holders.setdefault(d.gpu_index, set()).add(f"{d.namespace}/{d.claim}")
        rows = []
        for index, gpu in sorted(gpus.items()):
            u = usage.get(index)
            if u is None:
                continue
            rows.append(
                GpuRow(
                    index=index,
                    device=f"gpu-{index}",
                    product=gpu.product_name,
                    sm_utilization=_ratio(u.sm_utilization_percent),
                    memory_used_bytes=_bytes(u.memory_used_mib),
                    memory_total_bytes=gpu.memory_mib * _MIB,
                    processes=len(u.processes),
                    claims=tuple(sorted(holders.get(index, ()))),
                )
            )
        return tuple(rows)
