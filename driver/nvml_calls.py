"""The plumbing every part of the NVML backend shares: one NVML call turned into the typed
errors of ``driver.backend_errors``, GPU handles, and the state the parts read together (GPUs
seen, GPUs reported lost, health events not yet taken). The backend is assembled from one class
per job (enumeration here and in nvml_backend.py, MIG, sharing and MPS, health and usage) on
this base.
"""

from __future__ import annotations

import subprocess
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pynvml

from flexgpu.driver.backend import GpuBackend
from flexgpu.driver.backend_errors import (
    InvalidArgumentError,
    NotFoundError,
    NotSupportedError,
)
from flexgpu.driver.gpu_model import (
    HealthEvent,
    HealthEventKind,
    MigProfile,
)
from flexgpu.driver.nvml_errors import translate_nvml_error

CommandRunner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]

# NVML reports this for "no MIG instance" in per-process and per-event instance ids.
NO_INSTANCE = 0xFFFFFFFF
MIB = 1024 * 1024


def nvml_text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def instance_id(value: object) -> int | None:
    number = int(value)  # type: ignore[call-overload]
    return None if number == NO_INSTANCE else number


class NvmlCalls(GpuBackend):
    """State and NVML plumbing shared by the backend's parts; ``NvmlBackend`` sets it up."""

    _nvml: Any
    _lock: threading.RLock
    _known_uuids: dict[int, str]
    _reported_lost: set[str]
    _pending_events: deque[HealthEvent]
    _unhealthy: set[int]
    _event_set: Any
    _event_set_gpus: set[int]  # GPUs the event set was built over (registered or unable to)
    _event_set_stale: bool  # those GPUs no longer answer as they did: build it again
    _utilization_seen: dict[int, int]
    # (GPU UUID, MIG mode current) -> its MIG profiles with their placements: fixed by the
    # GPU's model and mode, and about 30 NVML calls to read.
    _mig_profile_cache: dict[tuple[str, bool], tuple[MigProfile, ...]]
    _run_command: CommandRunner
    _nvidia_smi: str
    _mps_root: Path
    _mps_control: str

    def _call(self, function: str, *args: Any, context: str = "") -> Any:
        try:
            return getattr(self._nvml, function)(*args)
        except (pynvml.NVMLError, pynvml.NVMLLibraryMismatchError) as exc:
            raise translate_nvml_error(exc, context or function) from None

    def _optional(self, function: str, *args: Any) -> Any:
        """A call whose failure on this GPU only means the field is unknown."""
        try:
            return self._call(function, *args)
        except (NotSupportedError, NotFoundError, InvalidArgumentError):
            return None

    def _mig_device_handles(self, handle: Any) -> Iterator[tuple[int, Any]]:
        """(GPU instance id, NVML handle) of every MIG device of the GPU; empty slots skipped."""
        for slot in range(int(self._call("nvmlDeviceGetMaxMigDeviceCount", handle))):
            try:
                mig = self._call("nvmlDeviceGetMigDeviceHandleByIndex", handle, slot)
            except NotFoundError:
                continue
            yield int(self._call("nvmlDeviceGetGpuInstanceId", mig)), mig

    def _handle(self, index: int) -> Any:
        try:
            return self._call("nvmlDeviceGetHandleByIndex", index, context=f"GPU {index}")
        except InvalidArgumentError:
            raise NotFoundError(f"no GPU with index {index}") from None

    def _note_lost(self, index: int) -> None:
        uuid = self._known_uuids.get(index)
        if uuid is not None and uuid not in self._reported_lost:
            self._reported_lost.add(uuid)
            self._pending_events.append(
                HealthEvent(kind=HealthEventKind.GPU_LOST, gpu_index=index, gpu_uuid=uuid)
            )
