"""GPU health and per-process use through NVML: Xid events from an event set, lost GPUs,
and the samples behind each GPU's and MIG instance's usage figures."""

from __future__ import annotations

from typing import Any

import pynvml

from flexgpu.driver.backend_errors import (
    GpuBackendError,
    GpuLostError,
    NotSupportedError,
)
from flexgpu.driver.gpu_model import (
    HealthEvent,
    HealthEventKind,
    ProcessSample,
)
from flexgpu.driver.nvml_calls import MIB, NvmlCalls, instance_id, nvml_text
from flexgpu.driver.nvml_errors import translate_nvml_error
from flexgpu.driver.usage import GpuUsage, usage_from_processes
from flexgpu.driver.xid import xid_marks_unhealthy

# Events a set about to be freed may still hold; more than NVML queues per set is not expected.
_DRAIN_LIMIT = 1024


class NvmlHealth(NvmlCalls):
    def _current_event_set(self) -> Any:
        """The event set to wait on, built anew when the GPUs it watches are no longer the
        GPUs that answer (one lost, one back): NVML answers every wait on a set holding a lost
        GPU with GPU_IS_LOST at once, so a set that kept it would never block again."""
        if self._event_set is not None and not self._event_set_stale:
            return self._event_set
        old = self._event_set
        if old is not None:
            self._drain(old)
        event_set = self._call("nvmlEventSetCreate")
        try:
            watched = self._register(event_set)
        except GpuBackendError:
            self._optional("nvmlEventSetFree", event_set)
            raise
        self._event_set, self._event_set_gpus, self._event_set_stale = event_set, watched, False
        if old is not None:
            self._optional("nvmlEventSetFree", old)
        return event_set

    def _register(self, event_set: Any) -> set[int]:
        """Registers every GPU that answers for its Xid events; the GPUs it went over."""
        watched: set[int] = set()
        for index in range(int(self._call("nvmlDeviceGetCount"))):
            try:
                handle = self._handle(index)
                self._known_uuids.setdefault(
                    index, nvml_text(self._call("nvmlDeviceGetUUID", handle))
                )
                supported = self._optional("nvmlDeviceGetSupportedEventTypes", handle)
                mask = int(supported or 0) & pynvml.nvmlEventTypeXidCriticalError
                if mask:
                    self._call("nvmlDeviceRegisterEvents", handle, mask, event_set)
                watched.add(index)
            except GpuLostError:
                self._note_lost(index)
            except NotSupportedError:
                self._note_lost(index)
                watched.add(index)  # it answers, only not to this: building again won't help
        return watched

    def _drain(self, event_set: Any) -> None:
        """Keeps the events a set still holds before it is freed with its queue (an Xid of
        another GPU raised just before the one that was lost)."""
        for _ in range(_DRAIN_LIMIT):
            try:
                data = self._nvml.nvmlEventSetWait(event_set, 0)
            except pynvml.NVMLError:
                return  # empty (TIMEOUT), or GPU_IS_LOST, which NVML answers once it is empty
            try:
                event = self._event_from(data)
            except GpuLostError:
                continue  # its GPU is gone: reported by the enumeration instead
            if event is not None:
                self._pending_events.append(event)

    def _answering_gpus_changed(self, answering: set[int]) -> None:
        """Called by every enumeration: a set watching other GPUs than those that answer now
        is built again before the next wait (by the waiting thread, which alone may free it)."""
        if self._event_set is not None and answering != self._event_set_gpus:
            self._event_set_stale = True

    def wait_health_event(self, timeout_s: float) -> HealthEvent | None:
        with self._lock:
            if self._pending_events:
                return self._pending_events.popleft()
            event_set = self._current_event_set()
            if self._pending_events:  # drained from the set it replaced
                return self._pending_events.popleft()
        try:
            data = self._nvml.nvmlEventSetWait(event_set, max(int(timeout_s * 1000), 0))
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_ERROR_TIMEOUT:
                return None
            if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                return self._find_lost_gpu()
            raise translate_nvml_error(exc, "wait for GPU events") from None
        with self._lock:
            try:
                return self._event_from(data)
            except GpuLostError:
                # Its GPU fell off the bus after raising it (Xid 79 comes so): reported lost.
                return self._find_lost_gpu()

    def _event_from(self, data: Any) -> HealthEvent | None:
        """The health event for NVML's event data; None for other event types and GPUs this
        backend never enumerated. GpuLostError when the event's GPU no longer answers."""
        if not int(data.eventType) & pynvml.nvmlEventTypeXidCriticalError:
            return None
        uuid = nvml_text(self._call("nvmlDeviceGetUUID", data.device))
        index = self._index_of(uuid)
        if index is None:
            return None
        xid = int(data.eventData)
        if xid_marks_unhealthy(xid):
            self._unhealthy.add(index)
        return HealthEvent(
            kind=HealthEventKind.XID,
            gpu_index=index,
            gpu_uuid=uuid,
            xid=xid,
            gpu_instance_id=instance_id(data.gpuInstanceId),
            compute_instance_id=instance_id(data.computeInstanceId),
        )

    def _find_lost_gpu(self) -> HealthEvent | None:
        """NVML says a GPU of the event set is lost, not which: a fresh enumeration finds it
        (reported once, as a GPU_LOST event), and the set is built again without it at once,
        so events raised from here on are caught and the next wait blocks again."""
        with self._lock:
            self.list_gpus()
            rebuilt = self._event_set_stale
            if rebuilt:
                self._current_event_set()
            if self._pending_events:
                return self._pending_events.popleft()
            if rebuilt:
                return None  # the lost GPU was reported before; the new set leaves it out
        # Every GPU the set watches still answers: a set built again would answer the same at
        # once. A failed wait instead, so the caller backs off and, if it lasts, treats NVML
        # as unavailable.
        raise GpuLostError(
            "NVML's event wait answers GPU_IS_LOST, yet every GPU of the node answers"
        )

    def _index_of(self, uuid: str) -> int | None:
        for _ in range(2):
            for index, known in self._known_uuids.items():
                if known == uuid:
                    return index
            self.list_gpus()  # indices may have been learnt before this GPU appeared
        return None

    def process_samples(self, index: int) -> list[ProcessSample]:
        with self._lock:
            handle = self._handle(index)
            processes = self._call("nvmlDeviceGetComputeRunningProcesses", handle)
            since = self._utilization_seen.get(index, 0)
            utilization: dict[int, Any] = {}
            for sample in self._optional("nvmlDeviceGetProcessUtilization", handle, since) or []:
                utilization[int(sample.pid)] = sample
                self._utilization_seen[index] = max(
                    self._utilization_seen.get(index, 0), int(sample.timeStamp)
                )
            samples = []
            for process in processes:
                pid = int(process.pid)
                used = process.usedGpuMemory
                util = utilization.get(pid)
                samples.append(
                    ProcessSample(
                        pid=pid,
                        used_memory_mib=None if used is None else int(used) // MIB,
                        sm_utilization_percent=int(util.smUtil) if util is not None else None,
                        memory_utilization_percent=int(util.memUtil) if util is not None else None,
                        gpu_instance_id=instance_id(process.gpuInstanceId),
                        compute_instance_id=instance_id(process.computeInstanceId),
                    )
                )
            return samples

    def gpu_usage(self, index: int) -> GpuUsage:
        with self._lock:
            handle = self._handle(index)
            processes = self.process_samples(index)
            # NOT_SUPPORTED in MIG mode, where NVML has no device-level utilisation.
            rates = self._optional("nvmlDeviceGetUtilizationRates", handle)
            memory = self._optional("nvmlDeviceGetMemoryInfo", handle)
            mode = self._optional("nvmlDeviceGetMigMode", handle)
            instances: dict[int, int | None] = {}
            if mode is not None and int(mode[0]) == pynvml.NVML_DEVICE_MIG_ENABLE:
                for gi_id, mig in self._mig_device_handles(handle):
                    info = self._optional("nvmlDeviceGetMemoryInfo", mig)
                    instances[gi_id] = None if info is None else int(info.used) // MIB
        usage = usage_from_processes(
            index,
            processes,
            list(instances),
            None if rates is None else int(rates.gpu),
            None if memory is None else int(memory.used) // MIB,
        )
        # An instance's own memory figure (it includes what the driver holds there).
        mig = tuple(
            m.model_copy(update={"memory_used_mib": instances[m.gpu_instance_id]})
            if instances.get(m.gpu_instance_id) is not None
            else m
            for m in usage.mig
        )
        return usage.model_copy(update={"mig": mig})
