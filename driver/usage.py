"""What a GPU is doing right now: SM utilisation, memory in use and the processes on it, for
the whole GPU and for each of its MIG instances. Read through ``GpuBackend.gpu_usage``.

NVML reports device utilisation for a whole GPU only; on a MIG instance it has memory and
processes (per-process utilisation where the driver samples it), so a figure NVML lacks is
``None`` rather than a guess. A GPU or instance with no process at all is idle by definition:
its utilisation is 0 even where NVML would not say.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from flexgpu.driver.gpu_model import ProcessSample


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class MigUsage(_Frozen):
    gpu_instance_id: int = Field(ge=0)
    memory_used_mib: int | None = None
    # Sum of its processes' sampled SM utilisation, in percent of the instance's own SMs.
    sm_utilization_percent: int | None = None
    processes: tuple[ProcessSample, ...] = ()


class GpuUsage(_Frozen):
    index: int = Field(ge=0)
    sm_utilization_percent: int | None = None
    memory_used_mib: int | None = None
    processes: tuple[ProcessSample, ...] = ()
    mig: tuple[MigUsage, ...] = ()


def summed_utilization(processes: Sequence[ProcessSample]) -> int | None:
    """SM utilisation of a set of processes: 0 with none, the capped sum of their samples,
    or ``None`` when processes run but none was sampled."""
    if not processes:
        return 0
    sampled = [p.sm_utilization_percent for p in processes if p.sm_utilization_percent is not None]
    if not sampled:
        return None
    return min(sum(sampled), 100)


def summed_memory(processes: Sequence[ProcessSample]) -> int | None:
    known = [p.used_memory_mib for p in processes if p.used_memory_mib is not None]
    if processes and not known:
        return None
    return sum(known)


def usage_from_processes(
    index: int,
    processes: Sequence[ProcessSample],
    gpu_instance_ids: Sequence[int] = (),
    sm_utilization_percent: int | None = None,
    memory_used_mib: int | None = None,
) -> GpuUsage:
    """A GpuUsage built from the processes: per MIG instance their sums; for the GPU the
    given device figures, else the sums over all processes."""
    mig = tuple(
        MigUsage(
            gpu_instance_id=gi,
            memory_used_mib=summed_memory(mine),
            sm_utilization_percent=summed_utilization(mine),
            processes=tuple(mine),
        )
        for gi in sorted(set(gpu_instance_ids))
        for mine in ([p for p in processes if p.gpu_instance_id == gi],)
    )
    if sm_utilization_percent is None and not gpu_instance_ids:
        sm_utilization_percent = summed_utilization(processes)
    if memory_used_mib is None:
        memory_used_mib = summed_memory(processes)
    return GpuUsage(
        index=index,
        sm_utilization_percent=sm_utilization_percent,
        memory_used_mib=memory_used_mib,
        processes=tuple(processes),
        mig=mig,
    )
