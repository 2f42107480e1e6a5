"""GPU health and per-process use through NVML: Xid events from an event set, lost GPUs,
and the samples behind each GPU's and MIG instance's usage figures."""

from __future__ import annotations

from typing import Any

import pynvml

from flexgpu.driver.backend_errors import (
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


class NvmlHealth(NvmlCalls):
    def _ensure_event_set(self) -> Any:
        if self._event_set is not None:
            return self._event_set
        event_set = self._call("nvmlEventSetCreate")
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
            except (GpuLostError, NotSupportedError):
                self._note_lost(index)
        self._event_set = event_set
        return event_set

    def wait_health_event(self, timeout_s: float) -> HealthEvent | None:
        with self._lock:
            if self._pending_events:
                return self._pending_events.popleft()
            event_set = self._ensure_event_set()
        try:
            data = self._nvml.nvmlEventSetWait(event_set, max(int(timeout_s * 1000), 0))
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_ERROR_TIMEOUT:
                return None
            if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                # Some GPU of the set is gone; a fresh enumeration finds which.
                with self._lock:
                    self.list_gpus()
                    return self._pending_events.popleft() if self._pending_events else None
            raise translate_nvml_error(exc, "wait for GPU events") from None
        if not int(data.eventType) & pynvml.nvmlEventTypeXidCriticalError:
            return None
        with self._lock:
            uuid = nvml_text(self._call("nvmlDeviceGetUUID", data.device))
            index = self._index_of(uuid)
            if index is None:
                return None  # a GPU this backend never enumerated; nothing to attribute it to
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
